"""Generated stubs of the wire contract ``protos/common/v1/verifier.proto`` (proto package ``specdec.v1``).

Made by specdec/protogen.py at install time (setup.py build hook, ``make proto``); not committed. They live in
common/, the runtime's shared package, so that edge_client/ and cloud_verifier/ import them without depending on
the tooling package specdec/ (docs/architecture.md, "Where the stubs live").
"""
