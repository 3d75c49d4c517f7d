"""Reference operators: the book's equations in plain PyTorch (attention to KDA)."""
