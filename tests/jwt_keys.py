"""A local ES256 key set for the JWT tests: tokens signed here, the JWKS Envoy checks them with."""

from __future__ import annotations

import base64
import json

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def es256_token(key: ec.EllipticCurvePrivateKey, claims: dict, kid: str = "k1") -> str:
    header = {"alg": "ES256", "typ": "JWT", "kid": kid}
    signing = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}"
    r, s = decode_dss_signature(key.sign(signing.encode(), ec.ECDSA(hashes.SHA256())))
    return f"{signing}.{b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


def jwks(key: ec.EllipticCurvePrivateKey) -> dict:
    numbers = key.public_key().public_numbers()
    return {
        "keys": [
            {
                "kty": "EC",
                "crv": "P-256",
                "kid": "k1",
                "alg": "ES256",
                "use": "sig",
                "x": b64url(numbers.x.to_bytes(32, "big")),
                "y": b64url(numbers.y.to_bytes(32, "big")),
            }
        ]
    }
