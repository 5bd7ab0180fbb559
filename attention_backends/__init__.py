"""SGLang attention backends with hierarchical (tree) verification masks over the paged KV cache."""
