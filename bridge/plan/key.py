"""What a plan's fingerprint covers, as plain data, and what differs between two ranks' plans.

On a fingerprint mismatch the ranks exchange ``plan_key(plan)`` (JSON text, no
pickles) so that ``PlanMismatchError`` can say what differs, e.g. the trainers'
bfloat16 params against the receivers' float32 ones, instead of two hashes.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bridge.plan.bridge_plan import BridgePlan

__all__ = ["plan_key", "encode", "decode", "describe_difference"]


def plan_key(plan: BridgePlan) -> dict[str, Any]:
    """The inputs of ``plan.fingerprint`` as JSON-ready data: leaves, params, bucket size, balance, delivery."""
    leaves = {path: {"shape": list(lay.shape), "dtype": lay.dtype, "layout": repr(lay)}
              for path, lay in plan.source.items()}
    params = {}
    for p in plan.param_map.params:
        regions = repr([(r.leaf, str(r.box), r.offset, r.transpose, r.view) for r in p.regions])
        params[f"{p.name} on rank {p.rank}"] = {
            "shape": list(p.shape), "dtype": p.dtype,
            "regions": hashlib.sha256(regions.encode()).hexdigest()[:12]}
    return {"leaves": leaves, "params": params, "bucket_bytes": plan.bucket_bytes, "balance": plan.balance,
            "delivery": plan.delivery, "moves": len(plan.moves)}


def encode(key: dict[str, Any]) -> bytes:
    return json.dumps(key, sort_keys=True, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    return json.loads(data.decode())


def _values(table: dict[str, dict[str, Any]], field: str) -> str:
    found = sorted({str(v[field]) for v in table.values()})
    return ", ".join(found) if found else "none"


def _table_difference(what: str, a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        out.append(f"{what}s only on one side: {len(only_a)} vs {len(only_b)} "
                   f"(e.g. {(only_a or only_b)[0]!r})")
    if _values(a, "dtype") != _values(b, "dtype"):
        out.append(f"{what} dtypes {_values(a, 'dtype')} vs {_values(b, 'dtype')}")
    for field in ("shape", "regions", "layout"):
        differ = [k for k in sorted(set(a) & set(b)) if field in a[k] and a[k][field] != b[k].get(field)]
        if differ:
            k = differ[0]
            out.append(f"{len(differ)} {what}s differ in {field}, e.g. {k!r}: {a[k][field]} vs {b[k][field]}")
    return out


def describe_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """A short account of what differs between two ``plan_key`` results (``a`` against ``b``).

    Example:
      >>> from bridge.plan.key import describe_difference
      >>> a = {"leaves": {}, "params": {"w on rank 2": {"shape": [4], "dtype": "bfloat16", "regions": "x"}},
      ...      "bucket_bytes": 64, "balance": True, "moves": 1}
      >>> b = {**a, "params": {"w on rank 2": {"shape": [4], "dtype": "float32", "regions": "x"}}}
      >>> describe_difference(a, b)
      'param dtypes bfloat16 vs float32'
    """
    out = _table_difference("leaf", a["leaves"], b["leaves"])
    out += _table_difference("param", a["params"], b["params"])
    for field in ("bucket_bytes", "balance", "delivery"):
        if a.get(field) != b.get(field):
            out.append(f"{field} {a[field]} vs {b[field]}")
    if not out:  # the inputs agree, so the planners do not: different jreshard versions
        moves = f" ({a['moves']} vs {b['moves']} moves)" if a["moves"] != b["moves"] else ""
        out.append(f"the same inputs planned into different moves{moves}; run one jreshard version everywhere")
    return "; ".join(out)
