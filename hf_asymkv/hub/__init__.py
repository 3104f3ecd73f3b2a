"""Publishing and serving hand-off (tools over the core).

- :mod:`.publish`: a publish folder (scales, settings, model card), optionally pushed to the Hub.
- :mod:`.model_card`: the model card text.
- :mod:`.vllm`: vLLM interchange (export our ranges as FP8 KV scales, import such scales back).
- :mod:`.serving`: a complete serving checkpoint (weights linked, KV scales added, compressed-tensors config).
- :mod:`.sglang`: SGLang's ``--quantization-param-path`` JSON.

Reading a publish folder back is core (:mod:`hf_asymkv.core.pretrained`), so ``from_pretrained`` needs no tool.
"""
