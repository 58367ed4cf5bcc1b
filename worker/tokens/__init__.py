"""Visual tokens: their tensors (tensors.py, safetensors in the cache), the store that encodes
images into them through the cache (store.py), how many of them reach the language model
(pruning, merging, reduction), the packing of requests by token count (packing.py) and the
requests built from them (request_builder.py)."""
