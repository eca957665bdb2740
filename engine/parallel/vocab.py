"""The padded vocabulary, the one rule (torch-free: the planner in tools/plan.py uses it too)."""


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of divisible_by x tp, so every TP rank holds an equal slice of
    aligned width (Megatron's make_vocab_size_divisible_by); the padding rows are zeros, masked in the loss."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple
