"""Loading targets and drafts: `load_target("smollm2" | hf_dir | file.gguf)`, `load_draft(eagle_dir)`."""
from eyas.loader.eagle import load_draft, save_draft
from eyas.loader.resolve import load_target, resolve_device, resolve_dtype

__all__ = ["load_target", "load_draft", "save_draft", "resolve_device", "resolve_dtype"]
