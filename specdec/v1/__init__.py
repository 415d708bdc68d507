"""Generated stubs of protos/specdec/v1 (made by specdec/protogen.py at install time; not committed)."""
