"""FlashKDA (third-party, MIT) called through ctypes: its build script and loader."""
