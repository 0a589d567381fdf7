"""Weight file formats of the edge runtime beyond plain HF safetensors: quantized checkpoints
(``quantized_checkpoint``, written by ``lowband edge quantize --bits``) and GGUF (``gguf``)."""
