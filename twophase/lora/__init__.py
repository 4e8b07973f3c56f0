"""LoRA adapters: PEFT's format read and checked (``peft_adapter``), applied unmerged, many in one
batch (``layer``)."""
