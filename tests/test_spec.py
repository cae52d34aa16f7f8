"""spec.py: the dataclasses a match hands from describe to verify and rewrite."""

import ast
import inspect

from moe_fuse import spec


def test_each_field_is_declared_once():
    """A field declared twice keeps its first place with the second default: a silent overwrite."""
    tree = ast.parse(inspect.getsource(spec))
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)]
        assert len(names) == len(set(names)), f"{cls.name} declares {sorted(n for n in names if names.count(n) > 1)}"
