"""A toy tokenizer for rollout tests: token ids written as space-separated integers."""

EOS, PAD = 4, 5


class IdTokenizer:
    """``encode`` / ``decode`` / ``bos_id`` / ``eos_id`` / ``pad_id`` over integer text ("3 0 2")."""

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return None

    def eos_id(self):
        return EOS

    def pad_id(self):
        return PAD
