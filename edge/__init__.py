"""edge (top-level package): Llama-family inference on edge devices (tensor parallel, streaming)."""
