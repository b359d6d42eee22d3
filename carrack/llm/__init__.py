"""Run GGUF language models: a KV-cached decoder (model.py), tokenizers from the file (tokenizer.py), and a
llama-cpp-python-shaped API (api.py: `Llama`)."""
