"""The demo: a small character-level GPT trained with zerokit on a public-domain corpus."""
