"""The learning half of ``key_codes.py``: calibration keys and query moments, weighted k-means, a fitted code.

Everything here is float32 torch on the CPU. Shapes: keys ``[Hk, N, D]`` (KV heads, calibration tokens, head_dim),
query second moments ``[Hk, D, D]``, RoPE tables ``[positions, D]``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_asymkv.calibration.data import pack_samples, stream_texts
from hf_asymkv.core.rotation import rotate, unrotate
from hf_asymkv.models import input_device

BLOCK = 64
MAX_POINTS = 32768  # training points per codebook (a random subset beyond it)
ITERS = 12  # Lloyd iterations per stage


def rope_tables(model, n: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(cos, sin)`` ``[n, D]`` of positions ``0 .. n-1``, from the model's own rotary embedding (one
    table per layer type: Gemma-3's sliding and full layers rotate with different bases)."""
    text = model.config.get_text_config(decoder=True)
    rotary = model.get_decoder().rotary_emb
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    x = torch.zeros(1, n, 1, device=input_device(model))
    pos = torch.arange(n, device=x.device)[None]
    by_type = {}
    for kind in set(types):
        takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
        cos, sin = rotary(x, pos, kind) if takes_type else rotary(x, pos)
        by_type[kind] = (cos[0].float().cpu(), sin[0].float().cpu())
    return {i: by_type[kind] for i, kind in enumerate(types)}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def unrope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE undone: ``k [..., m, D]`` rotated back by the angles of ``cos``/``sin`` ``[m, D]``; ``unrope(k, cos,
    -sin)`` applies it."""
    return k * cos - _rotate_half(k) * sin


@dataclass
class LayerCalibration:
    """One layer's calibration: post-RoPE keys and values ``[Hk, N, D]``, their positions ``[N]``, ``E[q q^T]``
    ``[Hk, D, D]`` of the queries reading each KV head, post-RoPE and as a pre-RoPE code sees them, and the value
    metric ``sum_h W_o,h^T W_o,h`` ``[Hk, D, D]`` (``W_o,h``: the output projection's columns of query head h)."""

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    v_metric: torch.Tensor | None = None
    q_post: torch.Tensor | None = None
    q_pre: torch.Tensor | None = None
    count: int = 0


@dataclass
class Calibration:
    layers: dict[int, LayerCalibration]
    tokens: int
    source: str


def calibrate(model, tokenizer, data: str, samples: int, length: int, tables, seed: int = 0) -> Calibration:
    """Record every quantized layer's keys and query moments over ``samples`` x ``length`` tokens of ``data`` (read
    as ``hf-asymkv calibrate --data`` reads it), one forward pass per sample through a recording attention."""
    from hf_asymkv import AsymKVCache

    quantized = set(AsymKVCache(model.config).layer_configs)
    ids = pack_samples(stream_texts(data), tokenizer, length, samples)
    layers = {i: LayerCalibration() for i in quantized}
    gen = torch.Generator().manual_seed(seed)

    def record(module, query, key, value, attention_mask, **kwargs):
        i = module.layer_idx
        if i in layers:
            cal = layers[i]
            q, k = query[0].detach().float().cpu(), key[0].detach().float().cpu()  # [Hq, T, D], [Hk, T, D]
            hk, t, d = k.shape
            q = q.reshape(hk, -1, t, d)  # query heads g*group .. (g+1)*group - 1 read KV head g
            cos, sin = tables[i]
            key_pos = (torch.rand(t, generator=gen) * (torch.arange(t) + 1)).long()  # a key position <= the query's
            rel = unrope(q, cos[key_pos], sin[key_pos])
            post = torch.einsum("hgtd,hgte->hde", q, q)
            pre = torch.einsum("hgtd,hgte->hde", rel, rel)
            cal.q_post = post if cal.q_post is None else cal.q_post + post
            cal.q_pre = pre if cal.q_pre is None else cal.q_pre + pre
            cal.count += q.shape[1] * t
            cal.keys.append(k)
            cal.values.append(value[0].detach().float().cpu())
            if cal.v_metric is None:
                w = module.o_proj.weight.detach().float().cpu().reshape(-1, hk, q.shape[1], d)  # [hidden, Hk, g, D]
                cal.v_metric = torch.einsum("xhgd,xhge->hde", w, w)
            cal.positions.append(torch.arange(t))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("key_codes_record", record)
    before = model.config._attn_implementation
    model.set_attn_implementation("key_codes_record")
    try:
        with torch.no_grad():
            for sample in ids:
                model(input_ids=sample.to(input_device(model)), use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(before)
    for cal in layers.values():
        cal.keys, cal.values = torch.cat(cal.keys, dim=1), torch.cat(cal.values, dim=1)
        cal.positions = torch.cat(cal.positions)
        cal.q_post, cal.q_pre = cal.q_post / cal.count, cal.q_pre / cal.count
    return Calibration(layers, sum(s.shape[1] for s in ids), data)


def assign(x: torch.Tensor, books: torch.Tensor) -> torch.Tensor:
    """Nearest entry of ``books [B, K, g]`` for each point of ``x [B, n, g]``: ``[B, n]`` indices."""
    b, n, _ = x.shape
    chunk = max(1, (1 << 25) // max(1, b * books.shape[1]))
    norms = books.pow(2).sum(-1)[:, None, :]
    out = []
    for i in range(0, n, chunk):
        part = x[:, i : i + chunk]
        out.append((norms - 2 * part @ books.transpose(1, 2)).argmin(-1))
    return torch.cat(out, dim=1)


def kmeans(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """``B`` independent k-means of ``x [B, N, g]`` into ``k`` entries (random points to start, :data:`ITERS`
    Lloyd steps, an emptied entry restarted at a random point): ``[B, k, g]``."""
    b, n, g = x.shape
    books = torch.stack([x[j, torch.randint(n, (k,), generator=gen)] for j in range(b)])
    for _ in range(ITERS):
        a = assign(x, books)
        sums = torch.zeros(b, k, g).scatter_add_(1, a[..., None].expand(-1, -1, g), x)
        counts = torch.zeros(b, k).scatter_add_(1, a, torch.ones(b, n))
        fresh = torch.stack([x[j, torch.randint(n, (k,), generator=gen)] for j in range(b)])
        books = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], fresh)
    return books


def channel_groups(head_dim: int, group: int) -> torch.Tensor:
    """``[head_dim / group, group]`` channel indices: each group is ``group / 2`` whole rotary pairs ``(i, i + D/2)``."""
    half, pairs = head_dim // 2, group // 2
    return torch.stack([torch.cat([torch.arange(j, j + pairs), torch.arange(j, j + pairs) + half])
                        for j in range(0, half, pairs)])


def block_range(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (head, 64-token block, channel) midpoint and half-range of ``x [H, m, D]`` (m a multiple of 64), float16
    as the presets store a scale and zero, broadcast back to ``[H, m, D]``."""
    h, m, d = x.shape
    g = x.reshape(h, m // BLOCK, BLOCK, d)
    lo, hi = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
    mid = ((hi + lo) / 2).half().float()
    half = ((hi - lo) / 2).clamp_min(1e-6).half().float()
    return (mid.expand_as(g).reshape(h, m, d), half.expand_as(g).reshape(h, m, d))


@dataclass
class FittedCode:
    """A learned key code of one layer (``key_codes.Design``): codebooks ``[Hk, G or 1, stages, K, g]`` in weighted
    coordinates, the per-group maps into them ``L [Hk, G, g, g]`` and back ``L_inv``, the channel groups, the static
    channel scale ``[Hk, D]`` and the RoPE table for pre-RoPE codes."""

    design: object
    books: torch.Tensor
    lower: torch.Tensor
    lower_inv: torch.Tensor
    groups: torch.Tensor
    scale: torch.Tensor
    table: tuple

    def static_bytes(self) -> int:
        """Bytes a cache would hold for this layer beyond the codes: float16 codebooks (in key units per group, or
        shared with a float16 ``L^-1`` per group), the channel scales of ``channel`` smoothing."""
        hk, n_books, stages, k, g = self.books.shape
        nbytes = hk * n_books * stages * k * g * 2
        if self.design.shared:
            nbytes += self.lower_inv.numel() * 2
        if self.design.smoothing == "channel":
            nbytes += self.scale.numel() * 2
        return nbytes

    def normalize(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """``x [H, m, D]`` in the code's coordinates (smoothing applied) and what undoes it."""
        if self.design.smoothing == "block":
            mid, half = block_range(x)
            return (x - mid) / half, (mid, half)
        return x / self.scale[:, None, :], (0.0, self.scale[:, None, :])

    def weighted(self, u: torch.Tensor) -> torch.Tensor:
        """``u [H, m, D]`` -> ``[H, G, m, g]`` grouped and mapped into the weighted coordinates."""
        return torch.einsum("hmgc,hgcd->hgmd", u[:, :, self.groups], self.lower)

    def encode_decode(self, k: torch.Tensor, start: int) -> torch.Tensor:
        """Post-RoPE keys ``[H, m, D]`` at positions ``start ..`` -> their decoded code, ``[H, m, D]``."""
        h, m, d = k.shape
        cos, sin = (t[start : start + m] for t in self.table)
        x = unrope(k, cos, sin) if self.design.rope == "pre" else k
        u, (mid, half) = self.normalize(x)
        w = self.weighted(u)  # [H, G, m, g]
        hk, n_books, stages, size, g = self.books.shape
        rest, decoded = w, torch.zeros_like(w)
        for s in range(stages):
            if n_books == 1:  # one codebook for every group of the head
                pts = rest.reshape(h, -1, g)
                got = torch.gather(self.books[:, 0, s], 1, assign(pts, self.books[:, 0, s])[..., None].expand(-1, -1, g))
            else:
                pts = rest.reshape(h * n_books, m, g)
                book = self.books[:, :, s].reshape(h * n_books, size, g)
                got = torch.gather(book, 1, assign(pts, book)[..., None].expand(-1, -1, g))
            got = got.reshape(w.shape)
            decoded, rest = decoded + got, rest - got
        back = torch.einsum("hgmd,hgdc->hmgc", decoded, self.lower_inv)  # [H, m, G, g]
        u_hat = torch.empty_like(u)
        u_hat[:, :, self.groups] = back
        x_hat = u_hat * half + mid
        return unrope(x_hat, cos, -sin) if self.design.rope == "pre" else x_hat

    def coder(self):
        """The block coder ``key_codes.CodedBlocks`` calls: ``(x [1, H, m, D], start) -> [1, H, m, D]``."""
        return lambda x, start: self.encode_decode(x[0].float(), start)[None]


def fit_design(design, cal: LayerCalibration, table, seed: int = 0) -> FittedCode:
    """Learn ``design``'s codebooks (or transform) for one layer from its calibration."""
    if design.kind == "transform":
        return fit_transform(design, cal, table)
    gen = torch.Generator().manual_seed(seed)
    keys = cal.keys
    hk, n, d = keys.shape
    if design.rope == "pre":
        keys = unrope(keys, table[0][cal.positions], table[1][cal.positions])
    groups = channel_groups(d, design.group)
    scale = keys.pow(2).mean(1).sqrt().clamp_min(1e-6) if design.smoothing == "channel" else torch.ones(hk, d)
    code = FittedCode(design, torch.empty(0), torch.empty(0), torch.empty(0), groups, scale, table)
    if design.smoothing == "block":
        mid, half = block_range(keys)
        u, metric_scale = (keys - mid) / half, half.mean(1)
    else:
        u, metric_scale = keys / scale[:, None, :], scale
    g = design.group
    if design.weighted:
        moment = cal.q_pre if design.rope == "pre" else cal.q_post  # [Hk, D, D]
        s = metric_scale[:, groups]  # [Hk, G, g]: in normalized units the error is scaled back by the smoothing
        m = moment[:, groups[:, :, None], groups[:, None, :]] * s[..., :, None] * s[..., None, :]
        m = m + 1e-6 * m.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(g)
        lower = torch.linalg.cholesky(m)  # M = L L^T: (u - c) M (u - c)^T = |u L - c L|^2 for row vectors
    else:
        lower = torch.eye(g).expand(hk, groups.shape[0], g, g).clone()
    # every group of a head in its own coordinates, normalized so a shared codebook sees comparable groups
    code.lower = lower / lower.diagonal(dim1=-2, dim2=-1).abs().mean((-1, -2), keepdim=True)[..., None]
    code.lower_inv = torch.linalg.inv(code.lower)
    w = code.weighted(u)  # [Hk, G, N, g]
    points = w.reshape(hk, -1, g) if design.shared else w.reshape(hk * groups.shape[0], n, g)
    if points.shape[1] > MAX_POINTS:
        points = points[:, torch.randperm(points.shape[1], generator=gen)[:MAX_POINTS]]
    books = []
    for _ in range(design.stages):
        book = kmeans(points, 2**design.code_bits, gen)
        books.append(book)
        points = points - torch.gather(book, 1, assign(points, book)[..., None].expand(-1, -1, g))
    n_books = 1 if design.shared else groups.shape[0]
    code.books = torch.stack(books, 1).reshape(hk, n_books, design.stages, 2**design.code_bits, g)
    return code


def round_blocks(z: torch.Tensor, widths: torch.Tensor, means: torch.Tensor,
                 reference: torch.Tensor | None = None, block: int = BLOCK) -> torch.Tensor:
    """``z [H, m, D]`` rounded per (head, ``block``-token block, component) to ``widths [H, D]`` bits, asymmetric min-max
    with float16 scale and zero (as ``round_keys``); a 0-bit component decodes to its calibration mean ``[H, D]``.

    With ``reference [H, D]`` (a typical block range of each component), 16 bits of metadata per block instead of
    32: the step is ``reference / (2^width - 1)`` times ``2^(e/16)`` with ``e`` an int8 (rounded up: the block's
    range fits), the levels an int8 number of steps from the calibration mean, centred on the block's midpoint
    (its extremes may then be clipped by up to half a step; at widths 7-8 the int8 zero may not reach a block whose
    midpoint is far from the mean, and the fit then sees the larger error and avoids those widths)."""
    h, m, d = z.shape
    g = z.reshape(h, m // block, block, d)
    top = (2.0 ** widths - 1).clamp_min(1)[:, None, None, :]
    lo, hi = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
    if reference is None:
        lo = lo.half().float()
        step = ((hi - lo) / top).clamp_min(1e-8).half().float()
    else:
        unit = (reference[:, None, None, :] / top).clamp_min(1e-8)
        e = torch.ceil(16 * torch.log2(((hi - lo) / top).clamp_min(1e-8) / unit)).clamp(-128, 127)
        step = unit * 2 ** (e / 16)
        mean = means[:, None, None, :]
        lo = (((hi + lo) / 2 - mean) / step - top / 2).round().clamp(-128, 127) * step + mean
    rounded = (((g - lo) / step).round().clamp_min(0).minimum(top) * step + lo).reshape(h, m, d)
    return torch.where(widths[:, None, :] > 0, rounded, means[:, None, :])


@dataclass
class TokenCode:
    """Values as the presets store them (Hadamard-rotated, rounded per token in groups of ``group`` channels to
    ``bits``, min-max), with a float16 scale and zero per group (``reference`` None) or 16-bit metadata as
    :func:`round_blocks` makes it (``reference [Hk]``: the median range of a rotated group on calibration text)."""

    bits: int
    group: int
    reference: torch.Tensor | None

    def static_bytes(self) -> int:
        return 0 if self.reference is None else self.reference.numel() * 2

    def encode_decode(self, v: torch.Tensor, start: int) -> torch.Tensor:
        """``v [H, m, D]`` -> its decoded code; each token's group of channels is one "block" of ``round_blocks``."""
        h, m, d = v.shape
        z = rotate(v).reshape(h, m * d // self.group, self.group).transpose(1, 2)  # [H, group, groups]
        n = z.shape[2]
        reference = None if self.reference is None else self.reference[:, None].expand(h, n)
        out = round_blocks(z, torch.full((h, n), float(self.bits)), torch.zeros(h, n), reference, self.group)
        return unrotate(out.transpose(1, 2).reshape(h, m, d))

    def coder(self):
        return lambda x, start: self.encode_decode(x[0].float(), start)[None]


def fit_token_code(cal: LayerCalibration, bits: int, group: int, meta_bits: int) -> TokenCode:
    """The per-token value code of ``bits`` with ``meta_bits`` (32 or 16) of metadata per group for one layer."""
    if meta_bits not in (32, 16):
        raise ValueError(f"meta_bits={meta_bits}: 32 (float16 scale and zero) or 16 allowed")
    if meta_bits == 32:
        return TokenCode(bits, group, None)
    groups = rotate(cal.values).reshape(cal.values.shape[0], -1, group)
    return TokenCode(bits, group, (groups.amax(-1) - groups.amin(-1)).median(1).values)


@dataclass
class FittedTransform:
    """A learned transform code of one layer's keys or values: ``z = x @ basis`` (``[Hk, D, D]``; x the keys post- or
    pre-RoPE, or the values), each component ``j`` rounded per 64-token block to ``widths[h, j]`` bits (0: its
    calibration mean), decoded as ``z_hat @ inverse``. A dense read-out multiplies by ``inverse``; an attention over
    the codes multiplies the query by ``inverse^T`` once per step instead (``q . (z inverse) = (q inverse^T) . z``),
    and the mixed values' output by ``inverse`` once."""

    basis: torch.Tensor
    inverse: torch.Tensor
    widths: torch.Tensor
    means: torch.Tensor
    reference: torch.Tensor | None  # [Hk, D]: 16-bit block metadata (``round_blocks``); None: float16 scale, zero
    table: tuple
    pre_rope: bool = False
    identity: bool = False

    def static_bytes(self) -> int:
        """The float16 inverse (none for the identity basis), the means (and references) and one byte per
        component width."""
        matrix = 0 if self.identity else self.inverse.numel() * 2
        reference = 0 if self.reference is None else self.reference.numel() * 2
        return matrix + self.means.numel() * 2 + reference + self.widths.numel()

    def bits(self) -> float:
        """Stored bits per element: codes, and the block metadata (32 or 16 bits per block) of every coded
        component."""
        meta = (32 if self.reference is None else 16) / BLOCK
        return float((self.widths + meta * (self.widths > 0)).mean())

    def encode_decode(self, k: torch.Tensor, start: int) -> torch.Tensor:
        m = k.shape[1]
        cos, sin = (t[start : start + m] for t in self.table)
        x = unrope(k, cos, sin) if self.pre_rope else k
        x_hat = round_blocks(x @ self.basis, self.widths, self.means, self.reference) @ self.inverse
        return unrope(x_hat, cos, -sin) if self.pre_rope else x_hat

    def coder(self):
        return lambda x, start: self.encode_decode(x[0].float(), start)[None]


def fit_components(x: torch.Tensor, moment: torch.Tensor, budget: float, identity: bool = False,
                   weighted: bool = True, meta_bits: int = 32) -> tuple[torch.Tensor | None, ...]:
    """``(basis, inverse, widths, means, reference)`` for ``x [Hk, N, D]`` whose error costs ``e^T moment e``
    (``[Hk, D, D]``): the basis is the KLT of block-centred ``x`` in that metric (or the identity), and ``budget``
    bits per element (block metadata of ``meta_bits`` counted; 16: ``reference`` is each component's median block
    range, else None) are spent greedily: each step gives more bits to the component whose calibration error,
    weighted by the metric, falls most per bit."""
    if meta_bits not in (32, 16):
        raise ValueError(f"meta_bits={meta_bits}: 32 (float16 scale and zero) or 16 allowed")
    hk, n, d = x.shape
    n = n // BLOCK * BLOCK
    x = x[:, :n]
    moment = moment + 1e-6 * moment.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(d)
    if identity:
        basis = torch.eye(d).expand(hk, d, d).clone()
    else:
        lower = torch.linalg.cholesky(moment) if weighted else torch.eye(d).expand(hk, d, d)
        w = (x @ lower).reshape(hk, n // BLOCK, BLOCK, d)
        centred = (w - w.mean(2, keepdim=True)).reshape(hk, n, d)
        _, vectors = torch.linalg.eigh(centred.transpose(1, 2) @ centred / n)
        basis = lower @ vectors.flip(-1)
    inverse = torch.linalg.inv(basis)
    weight = torch.einsum("hjd,hde,hje->hj", inverse, moment, inverse)  # cost per unit squared error of z_j
    z = x @ basis
    means = z.mean(1)
    reference = None
    if meta_bits == 16:
        blocks = z.reshape(hk, n // BLOCK, BLOCK, d)
        reference = (blocks.amax(2) - blocks.amin(2)).median(1).values
    errors = torch.stack([((round_blocks(z, torch.full((hk, d), float(b)), means, reference) - z).pow(2).mean(1))
                          * weight for b in range(9)], -1)  # [Hk, D, 9]
    cost = torch.arange(9.0) + meta_bits / BLOCK
    cost[0] = 0.0  # bits per element of width b: the code and, when coded at all, the block's metadata
    widths = torch.zeros(hk, d, dtype=torch.long)
    for h in range(hk):
        spent = 0.0
        while True:  # any wider width may be the next step (1 bit over a min-max range can be worse than none)
            now = widths[h]
            extra = cost[None, :] - cost[now][:, None]  # [D, 9]
            gain = (errors[h, torch.arange(d), now][:, None] - errors[h]) / extra.clamp_min(1e-9)
            gain[(extra <= 0) | (spent + extra > budget * d + 1e-9)] = -1
            j, b = divmod(int(gain.argmax()), 9)
            if gain[j, b] <= 0:
                break
            spent += float(extra[j, b])
            widths[h, j] = b
    return basis, inverse, widths.float(), means, reference


def fit_transform(design, cal: LayerCalibration, table) -> FittedTransform:
    """``design``'s key transform for one layer (the queries' second moment as the metric)."""
    keys = cal.keys
    pre = design.rope == "pre"
    if pre:
        keys = unrope(keys, table[0][cal.positions], table[1][cal.positions])
    parts = fit_components(keys, cal.q_pre if pre else cal.q_post, design.budget, design.basis == "identity",
                           design.weighted, design.meta_bits)
    return FittedTransform(*parts, table, pre, design.basis == "identity")


def fit_values(cal: LayerCalibration, budget: float, table, meta_bits: int = 32) -> FittedTransform:
    """A value transform for one layer: the metric is what a value error costs at the attention output projection,
    ``sum over the query heads reading the KV head of W_o,h^T W_o,h`` (``cal.v_metric``)."""
    return FittedTransform(*fit_components(cal.values, cal.v_metric, budget, meta_bits=meta_bits), table)
