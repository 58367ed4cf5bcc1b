"""Visual tokens: their tensors (tensors.py, safetensors in the cache), the store that encodes
images into them through the cache (store.py), how many of them reach the language model
(pruning, merging, reduction) and the packing of requests by token count (packing.py). Tokens
sit below models: what they need of a model is a Protocol here, the adapter is handed in
(tests/test_layers.py). The requests built from them are the generate stage's
(worker.stages.generate.requests)."""
