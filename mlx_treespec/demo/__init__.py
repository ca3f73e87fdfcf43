"""The shipped demo target, drafter and hybrid target (see bench/DEMO_PAIR.md)."""
