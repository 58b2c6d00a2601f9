"""`baton certs --out DIR`: a development CA and one certificate per service, for mutual TLS (tls_certs.py).

Point each service at DIR with BATON_<SERVICE>_TLS_DIR (`baton up --tls` does it for its children);
Kubernetes mounts the same files from a Secret, compose from a volume.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.tls_certs import CERT_SERVICES, make_dev_certs


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("certs", help="make a development CA and per-service certificates for mutual TLS")
    p.add_argument("--out", type=Path, required=True, help="directory to write the PEM files into")
    p.add_argument("--host", action="append", default=[],
                   help="another DNS name or IP for every certificate's SAN (repeatable)")
    p.add_argument("--days", type=int, default=365, help="validity")
    p.set_defaults(func=run_certs)


def run_certs(args: argparse.Namespace) -> int:
    files = make_dev_certs(args.out, CERT_SERVICES, args.host, args.days)
    for path in files:
        print(path)
    print(f"set BATON_<SERVICE>_TLS_DIR={args.out.resolve()} for every service (keep ca-key.pem elsewhere)")
    return 0
