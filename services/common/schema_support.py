"""What of a JSON Schema llguidance's grammar can enforce, and what the rest becomes.

llguidance compiles most of draft 2020-12 exactly. Two things it cannot:

- `oneOf` whose branches may overlap. "Exactly one branch" needs what a branch does
  not match, which a context-free grammar cannot say in general, so llguidance
  follows such a oneOf as anyOf, which is exact only when no value can match two
  branches. llguidance proves that itself in simple cases
  (branches of different types, an inline `const` discriminator); `exact_one_of`
  proves more (through local `$ref`s and `allOf`, `enum` discriminators, a property
  one branch requires and the other forbids) and rewrites each proved oneOf to
  anyOf, so that it compiles exact and without a warning.
- a few assertion keywords (`not`, `if`/`then`/`else`, `uniqueItems`, `contains`,
  `dependentRequired`, ...; llguidance names them), and minProperties/maxProperties
  beside optional properties (which it ignores with a warning). Each only narrows
  what the rest of its schema allows: removing it widens the set of valid outputs
  and never narrows it, so the grammar without it admits every valid output, and a
  finished output can be checked against the full schema afterwards.

A `Draft` is the working copy that `exact_one_of` and `relax` rewrite into what the
grammar follows; `relax` says what it gave up, each part named by its JSON pointer
in the client's schema, for the caller to refuse (strict mode) or to accept with
the output validated after generation. Walks are iterative: a schema's depth is
bounded by the size limit only (the proof's recursion by _MAX_PROOF_DEPTH).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

# Keywords whose value is one subschema, a list of them, or a map of name -> subschema
# (draft 2020-12 and the drafts before it); the places where keywords can occur.
_ONE_SCHEMA = ("additionalProperties", "additionalItems", "items", "contains", "not", "if",
               "then", "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
               "dependencies")

# Assertions that only narrow their schema (dropping one never rejects a valid value):
# the ones llguidance may leave unimplemented and an output check can take over.
# minContains/maxContains act only beside contains, and then/else only beside if, so
# they go together.
NARROWING_KEYWORDS = frozenset((
    "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "dependencies", "propertyNames",
    "unevaluatedProperties", "unevaluatedItems", "minProperties", "maxProperties",
))

ONE_OF_WARNING = "oneOf not fully supported"
# llguidance ignores minProperties/maxProperties beside optional properties (GitHub's
# workflow schema has them), and says so.
PROPERTY_COUNT_WARNING = "min/maxProperties only supported when"
_PROPERTY_COUNTS = frozenset(("minProperties", "maxProperties"))
UNIMPLEMENTED_WARNING = "Unimplemented keys: "

# How deep the disjointness proof follows properties and references; real
# discriminators sit one or two levels down.
_MAX_PROOF_DEPTH = 6
# Bounds on the proof's work, so that a hostile schema cannot make it long: views of
# one schema (itself, its $ref's target, its allOf members, ...) and branches of one
# oneOf (pairs grow as the square).
_MAX_VIEWS = 16
_MAX_PROVED_BRANCHES = 64
# Pairs compared in one document at most: about a second's work in the worst case;
# real schemas use a few hundred.
_PROOF_BUDGET = 200_000
# Past this many unproved oneOfs, `relax` counts them all as approximated rather
# than asking llguidance about each one (one validation per oneOf).
MAX_ONE_OF_PROBES = 16

_TYPES = frozenset(("null", "boolean", "object", "array", "number", "string"))

Schema = Any
"""A parsed JSON Schema: a dict, or True/False."""

# The metaschema URIs of the drafts, as llguidance and jsonschema know them; clients
# write them with https for http, without the "#", or as "json-schema.org/schema"
# (the latest draft), which llguidance would try to fetch and refuse.
_DIALECTS = {
    "json-schema.org/draft-04/schema": "http://json-schema.org/draft-04/schema#",
    "json-schema.org/draft-06/schema": "http://json-schema.org/draft-06/schema#",
    "json-schema.org/draft-07/schema": "http://json-schema.org/draft-07/schema#",
    "json-schema.org/draft/2019-09/schema": "https://json-schema.org/draft/2019-09/schema",
    "json-schema.org/draft/2020-12/schema": "https://json-schema.org/draft/2020-12/schema",
    "json-schema.org/schema": "https://json-schema.org/draft/2020-12/schema",
}


def canonical_dialect(uri: str) -> str:
    """The standard spelling of a draft's metaschema URI (other URIs unchanged)."""
    key = re.sub(r"^https?://", "", uri.strip()).rstrip("#")
    return _DIALECTS.get(key, uri)


def pointer(parts: tuple[str, ...]) -> str:
    """RFC 6901 JSON pointer of a path ("" is the whole document)."""
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def value_at(document: Any, where: str) -> Any:
    """The value at a JSON pointer (KeyError, IndexError or ValueError if none)."""
    node = document
    for raw in where.split("/")[1:] if where else ():
        part = raw.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def subschemas(schema: Schema) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every object-valued (sub)schema of a document with its path, the root first, each
    once. Values of non-schema keywords (const, enum, default, examples, x-*) are data
    and not entered, except where a local `$ref` points (real schemas keep groups of
    definitions under keys of their own: "#/definitions/common/agents")."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), schema)]
    seen: set[int] = set()
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield path, node
        for key, value in node.items():
            if key in _ONE_SCHEMA and isinstance(value, dict):
                stack.append(((*path, key), value))
            elif key in _SCHEMA_LIST and isinstance(value, list):
                stack.extend(((*path, key, str(i)), v) for i, v in enumerate(value))
            elif key in _SCHEMA_MAP and isinstance(value, dict):
                stack.extend(((*path, key, name), v) for name, v in value.items())
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            parts = tuple(p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/"))
            try:
                stack.append((parts, value_at(schema, ref[1:])))
            except (KeyError, IndexError, ValueError, TypeError):
                continue  # llguidance names a dangling reference itself


# ---- oneOf: proving branches disjoint ---------------------------------------------------


class _Resolver:
    """Local `$ref`s ("#", "#/a/b") of one document; anything else is unknown (None)."""

    def __init__(self, document: Schema) -> None:
        self._document = document
        self.budget = _PROOF_BUDGET
        """Pairs the proof may still compare in this document (then: not proved)."""

    def __call__(self, ref: Any) -> Schema | None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        try:
            node = value_at(self._document, ref[1:])
        except (KeyError, IndexError, ValueError, TypeError):
            return None
        return node if isinstance(node, (dict, bool)) else None


def _canonical(value: Any) -> str:
    """JSON equality as JSON Schema defines it (1 == 1.0, true != 1)."""
    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    return json.dumps(norm(value), sort_keys=True)


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _views(schema: Schema, resolve: _Resolver, depth: int) -> Iterator[Schema]:
    """Schemas that each hold every value `schema` accepts: itself, its `$ref`'s target
    and its allOf members (followed as far as `depth`)."""
    yield schema
    if depth <= 0 or not isinstance(schema, dict):
        return
    target = resolve(schema.get("$ref"))
    if target is not None:
        yield from _views(target, resolve, depth - 1)
    for member in schema.get("allOf", ()) if isinstance(schema.get("allOf"), list) else ():
        yield from _views(member, resolve, depth - 1)


def _types(schema: Schema) -> frozenset[str]:
    """The JSON types a schema can accept (integer counts as number)."""
    if schema is False:
        return frozenset()
    if not isinstance(schema, dict):
        return _TYPES
    declared = schema.get("type")
    names = [declared] if isinstance(declared, str) else declared
    types = _TYPES
    if isinstance(names, list):
        types = frozenset("number" if n == "integer" else n for n in names) & _TYPES
    if "const" in schema:
        types &= {_type_of(schema["const"])}
    if isinstance(schema.get("enum"), list):
        types &= {_type_of(v) for v in schema["enum"]}
    return types


def _values(schema: Schema) -> frozenset[str] | None:
    """The canonical values of a const/enum schema; None when not a finite set."""
    if not isinstance(schema, dict):
        return None
    found: frozenset[str] | None = None
    if "const" in schema:
        found = frozenset((_canonical(schema["const"]),))
    if isinstance(schema.get("enum"), list):
        listed = frozenset(_canonical(v) for v in schema["enum"])
        found = listed if found is None else found & listed
    return found


def _property_schema(schema: dict[str, Any], name: str) -> Schema | None:
    """What an object of `schema` may hold at `name`; None when patternProperties
    make it more than this proof follows."""
    properties = schema.get("properties")
    if isinstance(properties, dict) and name in properties:
        return properties[name]
    if schema.get("patternProperties"):
        return None
    return schema.get("additionalProperties", True)


def _directly_disjoint(a: Schema, b: Schema, resolve: _Resolver, depth: int) -> bool:
    resolve.budget -= 1
    if resolve.budget < 0:
        return False
    common = _types(a) & _types(b)
    if not common:
        return True
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None and not values_a & values_b:
        return True
    if common != {"object"} or not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    # Objects only: a property one requires that the other forbids or only allows
    # with values the first never takes (the const/enum discriminator).
    for first, second in ((a, b), (b, a)):
        required = first.get("required")
        for name in required if isinstance(required, list) else ():
            if not isinstance(name, str):
                continue
            mine, theirs = _property_schema(first, name), _property_schema(second, name)
            if mine is None or theirs is None:
                continue
            if mine is False or theirs is False or (
                    depth > 0 and disjoint(mine, theirs, resolve, depth - 1)):
                return True
    return False


def disjoint(a: Schema, b: Schema, resolve: _Resolver, depth: int = _MAX_PROOF_DEPTH) -> bool:
    """True only when no value can match both schemas (False: not proved)."""
    views_b = list(islice(_views(b, resolve, depth), _MAX_VIEWS))
    return any(_directly_disjoint(va, vb, resolve, depth)
               for va in islice(_views(a, resolve, depth), _MAX_VIEWS) for vb in views_b)


def _as_any_of(node: dict[str, Any]) -> None:
    """Rewrite the node's oneOf as anyOf, in place (beside an anyOf it already has,
    the new one goes into allOf: both must hold)."""
    branches = node.pop("oneOf")
    if "anyOf" not in node:
        node["anyOf"] = branches
    else:
        node["allOf"] = [*node.get("allOf", []), {"anyOf": branches}]


class Draft:
    """A working copy of a client's schema, rewritten in place, whose subschemas keep
    the JSON pointers they have in the client's schema (for messages)."""

    def __init__(self, original: Schema) -> None:
        self.original = original
        memo: dict[int, Any] = {}
        self.schema = copy.deepcopy(original, memo)
        self._pointers = {id(memo[id(node)]): pointer(path)
                          for path, node in subschemas(original)}
        self.changed = False

    def standard_dialects(self) -> None:
        """Spell every `$schema` of a known draft as llguidance knows it."""
        for node in self.nodes():
            uri = node.get("$schema")
            if isinstance(uri, str) and canonical_dialect(uri) != uri:
                node["$schema"] = canonical_dialect(uri)
                self.changed = True

    def client_schema(self) -> Schema:
        """The client's schema, its draft's URI spelt so that a validator knows it."""
        uri = self.original.get("$schema") if isinstance(self.original, dict) else None
        if not isinstance(uri, str) or canonical_dialect(uri) == uri:
            return self.original
        return {**self.original, "$schema": canonical_dialect(uri)}

    def pointer_of(self, node: dict[str, Any], key: str) -> str:
        return f"{self._pointers.get(id(node), '?')}/{key}"

    def nodes(self) -> list[dict[str, Any]]:
        return [node for _, node in subschemas(self.schema)]

    def one_of_as_any_of(self, node: dict[str, Any]) -> None:
        _as_any_of(node)
        self.changed = True

    def drop(self, node: dict[str, Any], key: str) -> None:
        del node[key]
        self.changed = True

    def variant(self, rewrite: list[dict[str, Any]]) -> Schema:
        """A copy of the schema with the oneOf of each of `rewrite`'s nodes as anyOf."""
        memo: dict[int, Any] = {}
        schema = copy.deepcopy(self.schema, memo)
        for node in rewrite:
            _as_any_of(memo[id(node)])
        return schema


def exact_one_of(draft: Draft) -> list[dict[str, Any]]:
    """Rewrite every oneOf of the draft whose branches are pairwise disjoint to anyOf;
    the nodes whose oneOf could not be proved disjoint."""
    resolve = _Resolver(draft.schema)
    unproved = []
    for node in draft.nodes():
        branches = node.get("oneOf")
        if not isinstance(branches, list):
            continue
        if len(branches) <= _MAX_PROVED_BRANCHES and all(
                disjoint(x, y, resolve) for i, x in enumerate(branches)
                for y in branches[i + 1:]):
            draft.one_of_as_any_of(node)
        else:
            unproved.append(node)
    return unproved


# ---- relaxing: what the grammar follows -----------------------------------------------


@dataclass(frozen=True)
class Relaxation:
    """What the grammar gives up of a client's schema, by JSON pointer."""

    approximated: tuple[str, ...] = ()
    """The oneOfs followed as anyOf (their branches may overlap)."""
    dropped: tuple[str, ...] = ()
    """The keywords the grammar does not enforce."""
    unsupported: tuple[str, ...] = ()
    """Keywords llguidance lacks that are not mere narrowings: the schema cannot be
    served at all."""
    other_warnings: tuple[str, ...] = ()
    """llguidance's warnings that neither of the above explains."""

    @property
    def exact(self) -> bool:
        return not (self.approximated or self.dropped)

    def notes(self) -> list[str]:
        """One line per relaxation, for the response's warnings."""
        return ([f"oneOf at {p} is followed as anyOf (its branches are not provably "
                 "disjoint); the output is validated against the schema after generation"
                 for p in self.approximated]
                + [f"{p.rsplit('/', 1)[-1]} at {p} is not enforced while generating; the "
                   "output is validated against the schema after generation"
                   for p in self.dropped])


Warnings = Callable[[Schema], list[str]]
"""llguidance's warnings for a schema (the grammar is not built for a tokenizer)."""


def relax(draft: Draft, unproved: list[dict[str, Any]], warnings: list[str],
          warnings_of: Warnings) -> Relaxation:
    """Rewrite the draft (after `exact_one_of`, which left `unproved`; llguidance warned
    `warnings` on it) into what the grammar can follow exactly: the narrowing keywords
    llguidance lacks removed, the oneOfs it would follow as anyOf written as anyOf."""
    dropped: list[str] = []
    unsupported: list[str] = []
    keys = _unimplemented_keys(warnings)
    counts = any(w.startswith(PROPERTY_COUNT_WARNING) for w in warnings)
    if keys or counts:
        for node in draft.nodes():
            found = keys & node.keys()
            if counts and not _all_required(node):
                found |= _PROPERTY_COUNTS & node.keys()
            for key in sorted(found):
                where = draft.pointer_of(node, key)
                if key not in NARROWING_KEYWORDS:
                    unsupported.append(where)
                    continue
                dropped.append(where)
                draft.drop(node, key)
        if unsupported:
            return Relaxation(unsupported=tuple(sorted(unsupported)))
        # Unproved oneOfs inside what was dropped are gone with it.
        alive = {id(node) for node in draft.nodes()}
        unproved = [node for node in unproved if id(node) in alive]
        warnings = warnings_of(draft.schema)
    approximated: list[dict[str, Any]] = []
    if any(w.startswith(ONE_OF_WARNING) for w in warnings):
        approximated = _approximated(draft, unproved, warnings_of)
        pointers = [draft.pointer_of(node, "oneOf") for node in approximated]
        for node in approximated:
            draft.one_of_as_any_of(node)
        warnings = warnings_of(draft.schema)
    else:
        pointers = []
    return Relaxation(tuple(sorted(pointers)), tuple(sorted(dropped)),
                      other_warnings=tuple(warnings))


def _approximated(draft: Draft, unproved: list[dict[str, Any]],
                  warnings_of: Warnings) -> list[dict[str, Any]]:
    """Which unproved oneOfs llguidance approximates: it warns without saying where, so
    each one is asked about alone, with the others as anyOf (exact, if disjoint)."""
    if len(unproved) <= 1 or len(unproved) > MAX_ONE_OF_PROBES:
        return unproved
    found = [candidate for candidate in unproved
             if any(w.startswith(ONE_OF_WARNING) for w in warnings_of(
                 draft.variant([n for n in unproved if n is not candidate])))]
    # A oneOf approximated only beside another (llguidance's proof of one needing the
    # other exact) still leaves the whole approximated: never report none.
    return found or unproved


def _all_required(node: dict[str, Any]) -> bool:
    """llguidance's condition for enforcing a property count (found by trying): no
    other property may be present, or every listed one is required."""
    if node.get("additionalProperties") is False:
        return True
    properties, required = node.get("properties"), node.get("required")
    names = set(properties) if isinstance(properties, dict) else set()
    return names <= set(required if isinstance(required, list) else ())


def _unimplemented_keys(warnings: list[str]) -> frozenset[str]:
    keys: set[str] = set()
    for warning in warnings:
        if warning.startswith(UNIMPLEMENTED_WARNING):
            # 'Unimplemented keys: ["not", "if"]', maybe with " (2 times)" after it.
            listed = warning[len(UNIMPLEMENTED_WARNING):].split("]", 1)[0] + "]"
            try:
                keys.update(k for k in json.loads(listed) if isinstance(k, str))
            except json.JSONDecodeError:
                continue
    return frozenset(keys)
