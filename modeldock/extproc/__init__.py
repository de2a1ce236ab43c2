"""The ext_proc service: authenticate, admit, pick, and count requests in flight."""
