"""Mutated and truncated copies of a valid file, and the rule every reader must follow on them (issue 56).

:func:`byte_mutations` yields seeded copies of some bytes: truncated, bytes overwritten (anywhere, or inside a
safetensors header), a run zeroed, a chunk inserted, deleted or repeated; :func:`json_mutations` adds structural
edits of a JSON document (a value swapped for another type, a huge, negative or non-finite number, a key dropped,
a deep nesting). Sizes stay bounded (at most the file plus a 4 KiB chunk), so no reader is handed a file that
could make it run long for the size alone.

:func:`check_reader` applies the rule: reading either refuses with ``ValueError`` (or ``FileNotFoundError``) whose
message names the file or folder, or accepts a file that is valid in every checked way (a mutation of tensor data
can leave a well-formed file with other values: no checksum can tell). Anything else (``TypeError``, ``KeyError``,
``RecursionError``, a crash) fails, naming the mutation that caused it.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Iterator

CHUNK = 4096  # the largest chunk a mutation inserts


def tiny_llama_scales(config, model_id: str = "org/tiny-llama"):
    """Valid scales for the tests' tiny Llama (2 layers, 2 KV heads, head_dim 16): what the fuzz starts from."""
    import torch

    from hf_asymkv.core.scales import KVScales, config_fingerprint

    g = torch.Generator().manual_seed(0)
    k = {i: torch.rand(2, 16, generator=g) * 5 + 0.1 for i in range(2)}
    v = {i: torch.rand(2, generator=g) * 3 + 0.1 for i in range(2)}
    return KVScales(k, v, {"fingerprint": json.dumps(config_fingerprint(config)), "model_id": model_id})


def _header_end(data: bytes) -> int:
    """End of a safetensors header (8-byte length + JSON), or of the whole data when it is not one."""
    if len(data) >= 8:
        n = int.from_bytes(data[:8], "little")
        if 8 + n <= len(data):
            return 8 + n
    return len(data)


def byte_mutations(data: bytes, count: int, seed: int) -> Iterator[tuple[str, bytes]]:
    """``count`` seeded mutated copies of ``data``: ``(what was done, bytes)``."""
    rng = random.Random(seed)
    header = max(_header_end(data), 1)
    for _ in range(count):
        kind = rng.choice(("truncate", "overwrite", "overwrite-header", "zero-run", "insert", "delete", "repeat"))
        out = bytearray(data)
        if kind == "truncate":
            cut = rng.randrange(len(data))
            out = out[:cut]
            kind += f"@{cut}"
        elif kind.startswith("overwrite"):
            span = header if kind == "overwrite-header" else len(data)
            for _ in range(rng.randint(1, 8)):
                out[rng.randrange(span)] = rng.randrange(256)
        elif kind == "zero-run":
            start = rng.randrange(len(data))
            out[start : start + rng.randint(1, 64)] = bytes(min(64, len(data) - start))[: rng.randint(1, 64)]
        elif kind == "insert":
            at = rng.randrange(len(data) + 1)
            out[at:at] = rng.randbytes(rng.randint(1, CHUNK))
        elif kind == "delete":
            start = rng.randrange(len(data))
            del out[start : start + rng.randint(1, 256)]
        else:  # repeat a chunk in place
            start = rng.randrange(len(data))
            chunk = out[start : start + rng.randint(1, 256)]
            out[start:start] = chunk
        yield kind, bytes(out)


NEST = "<nested 5000 deep>"  # stands for a nesting spliced into the text (json cannot build one that deep)
ODD_VALUES = [None, True, -1, 0, 2**64, -(2**63), 1e308, float("inf"), float("nan"), "", "x" * 300, [], {}, [1, "a"],
              {"a": {"b": None}}, "16", 3.5]


def _paths(doc, prefix=()) -> list[tuple]:
    """Every path to a value inside a JSON document (dict keys and list indices)."""
    out = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += _paths(value, (*prefix, i))
    return out


def _set(doc, path: tuple, value):
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


def json_mutations(text: str, count: int, seed: int) -> Iterator[tuple[str, bytes]]:
    """``count`` seeded structural edits of a JSON document, then as many byte mutations of it."""
    rng = random.Random(seed)
    for _ in range(count):
        doc = json.loads(text)
        path = rng.choice(_paths(doc))
        kind = rng.choice(("value", "value", "drop", "nest"))
        if kind == "drop" and path:
            parent = doc
            for key in path[:-1]:
                parent = parent[key]
            del parent[path[-1]]
        elif kind == "nest":
            doc = _set(doc, path, NEST)
        else:
            doc = _set(doc, path, rng.choice(ODD_VALUES))
        text_out = json.dumps(doc, allow_nan=True).replace(json.dumps(NEST), "[" * 5000 + "]" * 5000)  # deep, 10 KiB
        yield f"json-{kind}:{'/'.join(map(str, path))}", text_out.encode()
    yield from byte_mutations(text.encode(), count, seed + 1)


def check_reader(read: Callable[[], object], names: tuple[str, ...], what: str, tally: Counter,
                 valid: Callable[[object], None] | None = None) -> None:
    """Run ``read()`` on a mutated file: a refusal must be a ``ValueError``/``FileNotFoundError`` naming one of
    ``names``; an acceptance must pass ``valid(result)``. Counts ``"tried"``, ``"refused"``, ``"accepted"`` in
    ``tally``; ``what`` names the mutation in a failure."""
    tally["tried"] += 1
    try:
        result = read()
    except (ValueError, FileNotFoundError) as exc:
        assert any(name in str(exc) for name in names), f"{what}: the refusal names none of {names}: {exc}"
        tally["refused"] += 1
        return
    except Exception as exc:  # noqa: BLE001 - the point: any other exception is a defect, named with its mutation
        raise AssertionError(f"{what}: {type(exc).__name__} instead of a ValueError: {exc}") from exc
    if valid is not None:
        valid(result)
    tally["accepted"] += 1
