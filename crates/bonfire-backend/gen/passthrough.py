#!/usr/bin/env python3
"""Writes crates/bonfire-backend/src/passthrough.rs: every method of Burn 0.21's seven op traits,
defaulted ones included, forwarded from `DataParallel<I>` to `I`.

Run it after changing the pinned Burn version (the output is checked in):

    python3 crates/bonfire-backend/gen/passthrough.py

It reads the trait sources of the burn-backend crate that Cargo resolved for this workspace
(`cargo metadata`), so the output always matches the pinned version. Methods named in
OVERRIDDEN are left out; the decorator implements those by hand (see src/backend.rs).
"""
import json
import os
import re
import subprocess
import sys

# (trait, file under burn-backend's src/backend/ops)
TRAITS = [
    ("FloatTensorOps", "tensor.rs"),
    ("IntTensorOps", "int_tensor.rs"),
    ("BoolTensorOps", "bool_tensor.rs"),
    ("ModuleOps", "modules/base.rs"),
    ("ActivationOps", "activation.rs"),
    ("QTensorOps", "qtensor.rs"),
    ("TransactionOps", "transaction.rs"),
]

# Methods the decorator writes by hand instead of forwarding (none today: the data-parallel
# decorator changes no op; it only adds the gradient hook).
OVERRIDDEN = set()

# Types whose `Self` form is not the inner backend's type: how to convert an argument into the
# inner form (`{}` is the argument) and a result back (`{}` is the call).
CONVERT = {
    "TensorPrimitive": ("convert::primitive_in::<I>({})", "convert::primitive_out::<I>({})"),
    "QuantizationParametersPrimitive": ("convert::qparams_in::<I>({})", None),
    "TransactionPrimitive": ("convert::transaction_in::<I>({})", None),
    "MaxPool1dWithIndices": (None, "convert::max_pool1d_indices_out::<I>({})"),
    "MaxPool2dWithIndices": (None, "convert::max_pool2d_indices_out::<I>({})"),
    "MaxPool1dBackward": (None, "convert::max_pool1d_backward_out::<I>({})"),
    "MaxPool2dBackward": (None, "convert::max_pool2d_backward_out::<I>({})"),
    "DeformConv2dBackward": (None, "convert::deform_conv2d_backward_out::<I>({})"),
}


def registry_src():
    meta = json.loads(
        subprocess.check_output(
            ["cargo", "metadata", "--format-version", "1", ],
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    )
    for p in meta["packages"]:
        if p["name"] == "burn-backend":
            return os.path.join(os.path.dirname(p["manifest_path"]), "src", "backend", "ops"), p["version"]
    sys.exit("burn-backend is not in this workspace's dependency graph")


def split_top(text, sep=","):
    """Splits at `sep` outside (), [], <> and {}."""
    out, depth, cur, i = [], 0, "", 0
    while i < len(text):
        c = text[i]
        if c == "-" and text[i : i + 2] == "->":
            cur += "->"
            i += 2
            continue
        if c in "([<{":
            depth += 1
        elif c in ")]>}":
            depth -= 1
        if c == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    if cur.strip():
        out.append(cur)
    return [s.strip() for s in out if s.strip()]


def methods(path, trait):
    src = open(path).read()
    start = re.search(r"pub trait %s<B: Backend> \{" % trait, src)
    if not start:
        sys.exit(f"{trait} not found in {path}")
    i = start.end()
    depth = 1
    found = []
    while depth > 0:
        # Skip comments and strings at trait level.
        if src.startswith("//", i):
            i = src.index("\n", i)
            continue
        m = re.compile(r"\n    fn ").match(src, i) if depth == 1 else None
        if m:
            j = i + len("\n    ")
            # The signature ends at the first `;` or `{` outside brackets.
            d, k = 0, j
            while True:
                c = src[k]
                if src.startswith("->", k):
                    k += 2
                    continue
                if c in "([<":
                    d += 1
                elif c in ")]>":
                    d -= 1
                elif d == 0 and c in ";{":
                    break
                k += 1
            found.append(" ".join(src[j:k].split()))
            if src[k] == "{":
                depth += 1
            i = k + 1
            continue
        c = src[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        i += 1
    return found


def parse(sig):
    m = re.match(r"fn (\w+)\s*(<.*?>)?\s*\((.*)\)\s*(?:->\s*(.*))?$", sig)
    if not m:
        sys.exit(f"cannot parse: {sig}")
    name, generics, params, ret = m.groups()
    # Generic lists may contain `->` (closure bounds); re-find the parameter list by brackets.
    open_paren = sig.index("(", sig.index(name) + len(name) if not generics else sig.index(generics) + len(generics))
    d = 0
    for k in range(open_paren, len(sig)):
        if sig[k] == "(":
            d += 1
        elif sig[k] == ")":
            d -= 1
            if d == 0:
                break
    params = sig[open_paren + 1 : k]
    rest = sig[k + 1 :].strip()
    ret = rest[2:].strip() if rest.startswith("->") else None
    args = []
    for p in split_top(params):
        pname, ptype = p.split(":", 1)
        args.append((pname.strip().lstrip("_") or "arg", ptype.strip()))
    return name, generics or "", args, ret


def self_type(t):
    return re.sub(r"\bB\b", "Self", t).replace("crate::", "burn_backend::")


def generic_name(t):
    m = re.match(r"(?:&\s*)?(\w+)<Self>$", t)
    return m.group(1) if m else None


def main():
    ops, version = registry_src()
    out = [
        "// @generated by crates/bonfire-backend/gen/passthrough.py from burn-backend "
        + version
        + ". Do not edit by hand;",
        "// run `python3 crates/bonfire-backend/gen/passthrough.py` instead.",
        "//",
        "// Every method of every op trait, defaulted ones included, forwarded to the inner backend:",
        "// a default left in place would run Burn's generic fallback instead of the inner backend's",
        "// kernel, and would break `Autodiff` (which needs `float_set_require_grad` and friends).",
        "",
        "use burn_backend::ops::*;",
        "use burn_backend::quantization::*;",
        "use burn_backend::tensor::{BoolTensor, Device, FloatTensor, IntTensor, QuantizedTensor};",
        "use burn_backend::*;",
        "use core::future::Future;",
        "use core::ops::Range;",
        "",
        "use crate::backend::DataParallel;",
        "use crate::convert;",
        "",
    ]
    total = 0
    for trait, file in TRAITS:
        sigs = methods(os.path.join(ops, file), trait)
        out.append(f"impl<I: Backend> {trait}<Self> for DataParallel<I> {{")
        for sig in sigs:
            name, generics, args, ret = parse(sig)
            if name in OVERRIDDEN:
                continue
            total += 1
            params = ", ".join(f"{n}: {self_type(t)}" for n, t in args)
            call_args = []
            for n, t in args:
                g = generic_name(self_type(t))
                conv = CONVERT.get(g, (None, None))[0] if g else None
                if g in CONVERT and conv is None:
                    sys.exit(f"{name}: no argument conversion for {g}")
                call_args.append(conv.format(n) if conv else n)
            call = f"I::{name}({', '.join(call_args)})"
            rtype = self_type(ret) if ret else None
            if rtype:
                g = generic_name(rtype)
                if g in CONVERT:
                    conv = CONVERT[g][1]
                    if conv is None:
                        sys.exit(f"{name}: no result conversion for {g}")
                    call = conv.format(call)
            arrow = f" -> {rtype}" if rtype else ""
            out.append(f"    fn {name}{generics}({params}){arrow} {{")
            out.append(f"        {call}")
            out.append("    }")
        out.append("}")
        out.append("")
    dest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "passthrough.rs")
    with open(dest, "w") as f:
        f.write("\n".join(out))
    subprocess.check_call(["rustfmt", "--edition", "2024", dest])
    print(f"wrote {os.path.relpath(dest)}: {total} methods forwarded")


if __name__ == "__main__":
    main()
