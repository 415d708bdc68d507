"""Reading PEM material (certificates, private keys, CA bundles) for TLS, on both sides of the wire.

One function, used by the verifier's server credentials (:mod:`cloud_verifier.security.transport`) and the edge's channel
credentials (:mod:`edge_client.transport.credentials`), so both report a bad file with the same one-line message.
"""

from __future__ import annotations

import os
from pathlib import Path

PemSource = bytes | str | os.PathLike


def read_pem(source: PemSource, what: str) -> bytes:
    """The PEM bytes of ``source``: raw bytes, PEM text (a ``str`` containing ``-----BEGIN ``) or a file path.

    Args:
        source: the PEM itself (bytes or text) or the path of a PEM file.
        what: what the file is, for the error message (e.g. "TLS certificate").

    Raises:
        ValueError: the file cannot be read, or the data is not PEM (one line naming ``what`` and the path).
    """
    if isinstance(source, bytes):
        data, name = source, "(bytes)"
    elif isinstance(source, str) and "-----BEGIN " in source:
        data, name = source.encode(), "(text)"
    else:
        name = str(source)
        try:
            data = Path(source).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read the {what} {name}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"the {what} {name} is not a PEM file")
    return data
