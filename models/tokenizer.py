"""A byte-level tokenizer for the built-in tiny model (no files, no dependencies)."""

from __future__ import annotations


class ByteTokenizer:
    """Token ids 0..255 are UTF-8 bytes; ``bos_id`` / ``eos_id`` follow them."""

    def __init__(self, bos_id: int = 256, eos_id: int = 257):
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
