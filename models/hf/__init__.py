"""HuggingFace interop of the model families: the conversion core and one name table per
family (`tables` imports them all)."""
