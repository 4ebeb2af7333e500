"""Model classes SGLang's ModelRegistry imports from this package (each module exports EntryClass)."""
