"""Thin integrations with accelerate, transformers and timm; each imports its framework lazily."""
