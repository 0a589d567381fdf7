"""lowband.edge: Llama-family inference on edge devices (tensor parallel, weight streaming)."""
