#!/usr/bin/env python3
"""Writes the op-trait impls of bonfire's backend decorators: every method of Burn 0.21's seven op
traits, defaulted ones included, one output file per op family (as Burn's own decorators are laid
out), for each decorator in DECORATORS.

Run it after changing the pinned Burn version, or after adding or removing a hand-written rule
(the output is checked in):

    python3 crates/bonfire-backend/gen/passthrough.py            # every decorator
    python3 crates/bonfire-backend/gen/passthrough.py tensor_parallel
    python3 crates/bonfire-backend/gen/passthrough.py counting   # bonfire-testkit's op counter

It reads the trait sources of the burn-backend crate that Cargo resolved for this workspace
(`cargo metadata`), so the output always matches the pinned version.

A method's generated body is, in this order:
- a call to the decorator's hand-written rule of the same name, when its rules folder defines one
  (`pub(crate) fn <method>` in any file of `rules_dir`: the file is found by scanning, so adding a
  rule is writing the function and re-running this script);
- otherwise the decorator's default: `forward` calls the inner backend with the same arguments;
  `fallback` converts each float argument to the inner backend's full tensor (the decorator's
  `fallback` module gathers it and counts the gather under the method's name), calls the inner
  backend, and wraps float results as replicated.
Arguments and results whose type differs between the decorator and its inner backend are converted
by the templates in the decorator's `args`/`results` tables; a type missing there must be the same
type on both sides (the script refuses to guess).
"""
import json
import os
import re
import subprocess
import sys

# (trait, file under burn-backend's src/backend/ops, output file)
TRAITS = [
    ("FloatTensorOps", "tensor.rs", "float_ops.rs"),
    ("IntTensorOps", "int_tensor.rs", "int_ops.rs"),
    ("BoolTensorOps", "bool_tensor.rs", "bool_ops.rs"),
    ("ModuleOps", "modules/base.rs", "module_ops.rs"),
    ("ActivationOps", "activation.rs", "activation_ops.rs"),
    ("QTensorOps", "qtensor.rs", "qtensor_ops.rs"),
    ("TransactionOps", "transaction.rs", "transaction_ops.rs"),
]

# The types generic over the backend itself (not over its primitives), which every decorator
# converts, whatever its primitives. Arguments: `{a}` is the argument, `{op}` the method's name.
# `{tf}` is the conversion functions' type arguments: the decorator and its inner backend for
# those that keep the inner primitives (`crate::passthrough`), the inner backend for the others.
STRUCTS_IN = {
    "QuantizationParametersPrimitive<Self>": "{conv}::qparams_in::<{tf}>({a})",
    "TransactionPrimitive<Self>": "{conv}::transaction_in::<{tf}>({a})",
    "TensorPrimitive<Self>": "{conv}::primitive_in::<{tf}>({a})",
}
STRUCTS_OUT = {
    "TensorPrimitive<Self>": "{conv}::primitive_out::<{tf}>({c})",
    "MaxPool1dWithIndices<Self>": "{conv}::max_pool1d_indices_out::<{tf}>({c})",
    "MaxPool2dWithIndices<Self>": "{conv}::max_pool2d_indices_out::<{tf}>({c})",
    "MaxPool1dBackward<Self>": "{conv}::max_pool1d_backward_out::<{tf}>({c})",
    "MaxPool2dBackward<Self>": "{conv}::max_pool2d_backward_out::<{tf}>({c})",
    "DeformConv2dBackward<Self>": "{conv}::deform_conv2d_backward_out::<{tf}>({c})",
}

DECORATORS = {
    # Changes no op: every method calls the inner backend; only the gradient hook is its own.
    "data_parallel": {
        "type": "DataParallel",
        "module": "crate::data_parallel",
        "dir": "src/data_parallel/ops",
        "conv": "crate::passthrough",
        "tf": "Self, I",
        "rules_dir": None,
        # Its primitives are the inner backend's: float tensors pass as they are.
        "float_is_inner": True,
        "args": dict(STRUCTS_IN),
        "results": dict(STRUCTS_OUT),
    },
    # Float primitives carry a placement; int, bool and quantized ones are the inner backend's
    # (always replicated). A method without a rule gathers its float inputs and runs locally.
    "tensor_parallel": {
        "type": "TensorParallel",
        "module": "crate::tensor_parallel",
        "dir": "src/tensor_parallel/ops",
        "conv": "crate::tensor_parallel::fallback",
        "tf": "I",
        "rules_dir": "src/tensor_parallel/rules",
        # In a group of one (or none) every placement holds the whole tensor: a method with a
        # rule calls the inner backend's method of the same name instead, so that the inner
        # backend sees exactly the calls plain `Autodiff<I>` would make (bonfire-jobs' test
        # `no_hidden_arithmetic`). Methods that take a tensor by reference or return a future
        # keep their rule (those rules forward to the inner method themselves).
        "alone": {
            "check": "crate::tensor_parallel::context::alone()",
            "args": {
                "FloatTensor<Self>": "{conv}::alone::<{tf}>({a})",
                "Option<FloatTensor<Self>>": "{a}.map({conv}::alone::<{tf}>)",
                "Vec<FloatTensor<Self>>": "{a}.into_iter().map({conv}::alone::<{tf}>).collect()",
            },
        },
        # In a fully sharded data-parallel group (ZeRO stage 3, `tensor_parallel/fsdp.rs`) the
        # ranks' activations differ: a rule may only see tensors every rank agrees on. A method
        # whose inputs include a whole float tensor (`fallback::private`), an int or bool tensor
        # (indices, masks: the rank's own data), or that draws random numbers, falls back there.
        "private": {
            "check": "crate::tensor_parallel::context::fully_sharded()",
            "args": {
                "FloatTensor<Self>": "{conv}::private::<{tf}>(&{a})",
                "Option<FloatTensor<Self>>": "{a}.as_ref().is_some_and({conv}::private::<{tf}>)",
                "Vec<FloatTensor<Self>>": "{a}.iter().any({conv}::private::<{tf}>)",
            },
            "always": ["IntTensor<Self>", "BoolTensor<Self>"],
            # Random numbers, and shapes given by the caller (which may be a batch's).
            "draws": ["float_random", "float_expand", "float_slice"],
            # Its rule is local for every placement, and places a loaded optimizer state as its
            # parameter (`fsdp::place_state`).
            "exempt": ["float_to_device"],
            # Rules that read a tensor by reference or return a future, run unguarded: a read
            # (gathers in the order every rank reads), the device, the autodiff flag.
            "unguarded": ["float_into_data", "float_device", "float_is_require_grad"],
        },
        "float_is_inner": False,
        "args": {
            # Float data inside them is gathered, and counted under the method's name.
            "QuantizationParametersPrimitive<Self>": "{conv}::qparams_in::<{tf}>({a}, \"{op}\")",
            "TransactionPrimitive<Self>": "{conv}::transaction_in::<{tf}>({a}, \"{op}\")",
            "TensorPrimitive<Self>": "{conv}::primitive_in::<{tf}>({a}, \"{op}\")",
            "FloatTensor<Self>": "{conv}::full::<{tf}>({a}, \"{op}\")",
            "Option<FloatTensor<Self>>": "{a}.map(|t| {conv}::full::<{tf}>(t, \"{op}\"))",
            "Vec<FloatTensor<Self>>": "{conv}::full_all::<{tf}>({a}, \"{op}\")",
        },
        "results": {
            **STRUCTS_OUT,
            "FloatTensor<Self>": "{conv}::replicated::<{tf}>({c})",
            "(FloatTensor<Self>, IntTensor<Self>)": "{conv}::replicated_first::<{tf}, _>({c})",
            "(FloatTensor<Self>, FloatTensor<Self>)": "{conv}::replicated_pair::<{tf}>({c})",
        },
    },
    # bonfire-testkit's op counter: changes no op, and counts each call by the method's name before
    # it forwards (the check that a decorator stack runs exactly the inner ops of its backend).
    "counting": {
        "type": "Counting",
        "crate": "../bonfire-testkit",
        "module": "crate::counting",
        "dir": "src/counting/ops",
        "conv": "bonfire_backend::passthrough",
        "tf": "Self, I",
        "rules_dir": None,
        "float_is_inner": True,
        "args": dict(STRUCTS_IN),
        "results": dict(STRUCTS_OUT),
        "before": "crate::counting::count(\"{op}\");",
    },
}

# Self-typed forms that are the inner backend's own type in every decorator.
SAME_EVERYWHERE = re.compile(
    r"^(&)?(IntTensor|BoolTensor|QuantizedTensor|Device)<Self>$"
    r"|^(Vec|Option)<(IntTensor|BoolTensor|QuantizedTensor)<Self>>$"
    r"|^\((IntTensor|QuantizedTensor)<Self>, IntTensor<Self>\)$"
    r"|^impl Future<Output = IntTensor<Self>> \+ 'static \+ Send$"
)


def registry_src():
    meta = json.loads(
        subprocess.check_output(
            ["cargo", "metadata", "--format-version", "1"],
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
        # Skip comments at trait level.
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


def rules_of(crate_dir, rules_dir):
    """Method name -> the rules file (module path under `rules`) that defines it."""
    found = {}
    if not rules_dir:
        return found
    root = os.path.join(crate_dir, rules_dir)
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".rs") or f == "mod.rs":
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), root)[: -len(".rs")]
            module = rel.replace(os.sep, "::")
            for m in re.finditer(r"^pub\(crate\) fn (\w+)", open(os.path.join(dirpath, f)).read(), re.M):
                if m.group(1) in found:
                    sys.exit(f"rule {m.group(1)} is defined in both {found[m.group(1)]} and {module}")
                found[m.group(1)] = module
    return found


def convert(dec, table, t, op, **names):
    """The conversion of a value of Self-type `t`: a Rust expression, None when the decorator's
    and the inner backend's types are the same, False when the script does not know."""
    if t in table:
        return table[t].format(conv=dec["conv"], tf=dec["tf"], op=op, **names)
    if "Self" not in t or SAME_EVERYWHERE.match(t):
        return None
    if dec["float_is_inner"] and SAME_EVERYWHERE.match(t.replace("FloatTensor<Self>", "IntTensor<Self>")):
        return None
    return False


def imports(text):
    """The `use` lines the generated `text` needs (only those, so the output has no unused import)."""
    lines = ["use burn_backend::ops::*;"]
    if re.search(r"\bQuantization\w*|\bQuantScheme\b|\bQTensor\w*", text):
        lines.append("use burn_backend::quantization::*;")
    tensor = [n for n in ("BoolTensor", "Device", "FloatTensor", "IntTensor", "QuantizedTensor") if re.search(r"\b%s\b" % n, text)]
    if tensor:
        lines.append("use burn_backend::tensor::{%s};" % ", ".join(tensor))
    lines.append("use burn_backend::*;")
    if "Future<" in text:
        lines.append("use core::future::Future;")
    if "Range<" in text:
        lines.append("use core::ops::Range;")
    return lines


def forward(key, dec, arg_table, name, args, rtype):
    """The call of the inner backend's `name`, arguments converted by `arg_table` and the result
    by the decorator's `results` table."""
    call_args = []
    for n, t in args:
        c = convert(dec, arg_table, self_type(t), name, a=n)
        if c is False:
            sys.exit(f"{key}: {name}: no conversion for argument type {self_type(t)}; write a rule")
        call_args.append(c or n)
    call = f"I::{name}({', '.join(call_args)})"
    if rtype:
        c = convert(dec, dec["results"], rtype, name, c=call)
        if c is False:
            sys.exit(f"{key}: {name}: no conversion for result type {rtype}; write a rule")
        call = c or call
    return call


def generate(key, dec, ops, version, crate_dir):
    rules = rules_of(crate_dir, dec["rules_dir"])
    used = set()
    ty = dec["type"]
    out_dir = os.path.join(crate_dir, dec["dir"])
    os.makedirs(out_dir, exist_ok=True)
    counts = {"rule": 0, "default": 0}
    written = []
    for trait, file, out_file in TRAITS:
        body = [f"impl<I: Backend> {trait}<Self> for {ty}<I> {{"]
        for sig in methods(os.path.join(ops, file), trait):
            name, generics, args, ret = parse(sig)
            params = ", ".join(f"{n}: {self_type(t)}" for n, t in args)
            rtype = self_type(ret) if ret else None
            arrow = f" -> {rtype}" if rtype else ""
            guard = None
            if name in rules:
                used.add(name)
                counts["rule"] += 1
                call = f"{dec['module']}::rules::{name}::<I>({', '.join(n for n, _ in args)})"
                alone = dec.get("alone")
                by_ref = any(self_type(t).startswith("&") and "FloatTensor" in t for _, t in args)
                if alone and not by_ref and not (rtype or "").startswith("impl "):
                    inner = forward(key, dec, alone["args"], name, args, rtype)
                    guard = f"if {alone['check']} {{ return {inner}; }}"
                    counts["alone"] = counts.get("alone", 0) + 1
                private = dec.get("private")
                if private and (by_ref or (rtype or "").startswith("impl ")) and name not in private["exempt"] + private["unguarded"]:
                    sys.exit(f"{key}: {name}: a rule the fully sharded guard cannot wrap; list it in private.unguarded if it is safe")
                if private and not by_ref and not (rtype or "").startswith("impl ") and name not in private["exempt"]:
                    tests = []
                    for n, t in args:
                        t = self_type(t)
                        if any(a in t for a in private["always"]):
                            tests = ["true"]
                            break
                        if t in private["args"]:
                            tests.append(private["args"][t].format(conv=dec["conv"], tf=dec["tf"], a=n))
                    if name in private["draws"]:
                        tests = ["true"]
                    if tests:
                        fall = forward(key, dec, dec["args"], name, args, rtype)
                        cond = private["check"] if tests == ["true"] else f"{private['check']} && ({' || '.join(tests)})"
                        guard = (guard + "\n        " if guard else "") + f"if {cond} {{ return {fall}; }}"
                        counts["private"] = counts.get("private", 0) + 1
            else:
                counts["default"] += 1
                call = forward(key, dec, dec["args"], name, args, rtype)
            body.append(f"    fn {name}{generics}({params}){arrow} {{")
            if guard:
                body.append(f"        {guard}")
            if dec.get("before"):
                body.append("        " + dec["before"].format(op=name))
            body.append(f"        {call}")
            body.append("    }")
        body.append("}")
        body.append("")
        out = [
            f"// @generated by crates/bonfire-backend/gen/passthrough.py from burn-backend {version}. Do not edit",
            "// by hand; run `python3 crates/bonfire-backend/gen/passthrough.py` instead.",
            "",
            *imports("\n".join(body)),
            "",
            f"use {dec['module']}::{ty};",
            "",
            *body,
        ]
        dest = os.path.join(out_dir, out_file)
        with open(dest, "w") as f:
            f.write("\n".join(out))
        written.append(dest)
    unused = set(rules) - used
    if unused:
        sys.exit(f"{key}: rules that match no Burn op method (misspelt?): {sorted(unused)}")
    subprocess.check_call(["rustfmt", "--edition", "2024", *written])
    print(
        f"{key}: wrote {len(written)} files in {dec['dir']}: "
        f"{counts['rule']} methods by hand-written rules ({counts.get('alone', 0)} of them forwarded "
        f"in a group of one), {counts['default']} by default"
    )


def main():
    ops, version = registry_src()
    crate_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    wanted = sys.argv[1:] or list(DECORATORS)
    for key in wanted:
        if key not in DECORATORS:
            sys.exit(f"unknown decorator {key}; known: {', '.join(DECORATORS)}")
        dec = DECORATORS[key]
        if dec["rules_dir"] and not os.path.isdir(os.path.join(crate_dir, dec.get("crate", "."), dec["rules_dir"])):
            print(f"{key}: skipped ({dec['rules_dir']} does not exist yet)")
            continue
        generate(key, dec, ops, version, os.path.normpath(os.path.join(crate_dir, dec.get("crate", "."))))


if __name__ == "__main__":
    main()
