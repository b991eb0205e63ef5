//! The README, the book and every `--help` name only what exists: each `bonfire` command and
//! flag they show must be one the built command takes, each `BONFIRE_*` variable one the code
//! reads, and each type or `bonfire::` item they name one the code (or Burn, named below)
//! defines.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use regex::Regex;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .unwrap()
        .to_path_buf()
}

/// The commands the built `bonfire` takes (`""` for the top, `"train vision"`, ...) and the
/// flags of each, read from their `--help`; with every help text.
struct Cli {
    flags: HashMap<String, BTreeSet<String>>,
    helps: Vec<(String, String)>,
}

fn help(path: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_bonfire"))
        .args(path)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "bonfire {path:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

fn cli() -> Cli {
    let flag = Regex::new(r"(?m)^\s+(?:-\w, )?--([a-z0-9-]+)").unwrap();
    let alias = Regex::new(r"\[alias(?:es)?:\s+([^\]]+)\]").unwrap();
    let mut cli = Cli {
        flags: HashMap::new(),
        helps: Vec::new(),
    };
    let mut todo: Vec<Vec<String>> = vec![vec![]];
    while let Some(path) = todo.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).collect();
        let text = help(&args);
        // A flag's visible aliases are flags too: `[alias: --ranks]`, `[aliases: --a, --b]`.
        let aliases = alias.captures_iter(&text).flat_map(|c| {
            c[1].split(',')
                .filter_map(|a| a.trim().strip_prefix("--"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        });
        let flags = flag
            .captures_iter(&text)
            .map(|c| c[1].to_string())
            .chain(aliases)
            .collect();
        if let Some(cmds) = text.split("Commands:\n").nth(1) {
            for line in cmds.lines().take_while(|l| l.starts_with("  ")) {
                let name = line.split_whitespace().next().unwrap();
                if name != "help" {
                    let mut sub = path.clone();
                    sub.push(name.to_string());
                    todo.push(sub);
                }
            }
        }
        cli.flags.insert(path.join(" "), flags);
        cli.helps
            .push((format!("bonfire {} --help", path.join(" ")), text));
    }
    cli
}

/// Every `.rs` file under the workspace's code.
fn sources() -> Vec<String> {
    let mut out = Vec::new();
    let mut dirs: Vec<PathBuf> = ["crates", "models", "datasets", "examples"]
        .iter()
        .map(|d| root().join(d))
        .collect();
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if p.is_dir() && name != "target" && !name.starts_with('.') {
                dirs.push(p);
            } else if name.ends_with(".rs") && name != "docs_say_what_exists.rs" {
                out.push(std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    out
}

/// What the code defines or re-exports, and the string literals it holds.
struct Code {
    items: BTreeSet<String>,
    literals: String,
    /// Flags of the scripts in benches/ (argparse), which the docs show too.
    script_flags: BTreeSet<String>,
    /// What a build leaves under `target/release/`: the binaries and `examples/NAME`.
    binaries: BTreeSet<String>,
}

fn code() -> Code {
    let def = Regex::new(
        r"\b(?:struct|enum|trait|type|fn|mod|const|static|union)\s+([A-Za-z_][A-Za-z0-9_]*)",
    )
    .unwrap();
    let word = Regex::new(r"\b[A-Za-z_][A-Za-z0-9_]*\b").unwrap();
    // An enum's variants: a capitalised name alone at the start of a line, before `,`, `(`, `{`
    // or `=`.
    let variant = Regex::new(r"^\s+([A-Z][A-Za-z0-9]*)\s*(?:[,({=]|$)").unwrap();
    let lit = Regex::new(r#""(?:[^"\\]|\\.)*""#).unwrap();
    let mut code = Code {
        items: BTreeSet::new(),
        literals: String::new(),
        script_flags: BTreeSet::new(),
        binaries: ["bonfire".to_string()].into(),
    };
    let crates = std::fs::read_dir(root().join("crates"))
        .unwrap()
        .map(|k| k.unwrap().path())
        .chain([root().join("book/programs")]);
    for krate in crates {
        if let Ok(bins) = std::fs::read_dir(krate.join("src/bin")) {
            for b in bins {
                let p = b.unwrap().path();
                code.binaries
                    .insert(p.file_stem().unwrap().to_string_lossy().to_string());
            }
        }
    }
    for dir in ["examples"] {
        for e in std::fs::read_dir(root().join(dir)).unwrap() {
            code.binaries
                .insert(e.unwrap().file_name().to_string_lossy().to_string());
        }
    }
    // A crate's examples, where it has any (git keeps no empty folder).
    for dir in ["models/examples", "datasets/examples"] {
        let Ok(entries) = std::fs::read_dir(root().join(dir)) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            let stem = p.file_stem().unwrap().to_string_lossy().to_string();
            code.binaries.insert(format!("examples/{stem}"));
        }
    }
    for src in sources() {
        for line in src.lines() {
            let t = line.trim_start();
            if t.starts_with("//") {
                continue;
            }
            for c in def.captures_iter(line) {
                code.items.insert(c[1].to_string());
            }
            if let Some(c) = variant.captures(line) {
                code.items.insert(c[1].to_string());
            }
            for l in lit.find_iter(line) {
                code.literals.push_str(l.as_str());
                code.literals.push('\n');
            }
        }
    }
    // Re-exports make a name public under another path.
    let uses = Regex::new(r"(?s)pub use [^;]*;").unwrap();
    for src in sources() {
        for u in uses.find_iter(&src) {
            for w in word.find_iter(u.as_str()) {
                code.items.insert(w.as_str().to_string());
            }
        }
    }
    let arg = Regex::new(r#"add_argument\(\s*"--([a-z0-9_-]+)""#).unwrap();
    for e in std::fs::read_dir(root().join("benches")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "py") {
            let text = std::fs::read_to_string(&p).unwrap();
            for c in arg.captures_iter(&text) {
                code.script_flags.insert(c[1].to_string());
            }
        }
    }
    // Programs of ours that read their flags by hand (the Burn 0.22 guide): a match arm
    // `"--flag" =>`.
    let arm = Regex::new(r#""--([a-z0-9_-]+)"\s*=>"#).unwrap();
    for src in sources() {
        for c in arm.captures_iter(&src) {
            code.script_flags.insert(c[1].to_string());
        }
    }
    code
}

/// Names from outside bonfire that the docs may use: Burn's, the standard library's and the
/// peers' (in comparisons).
const FOREIGN_TYPES: &[&str] = &[
    "GradientsAccumulator",
    // Burn 0.22's one-process strategy (`ExecutionStrategy::MultiDevice`).
    "MultiDevice",
    "Autodiff",
    "Wgpu",
    "WgpuDevice",
    "Flex",
    "FlexDevice",
    "NdArray",
    "NdArrayDevice",
    "Cuda",
    "CudaDevice",
    "Fusion",
    "CubeBackend",
    "CudaRuntime",
    "WgpuRuntime",
    "Backend",
    "AutodiffBackend",
    "Module",
    "Tensor",
    "TensorData",
    "Int",
    "Bool",
    "Param",
    "Linear",
    "LinearConfig",
    "Conv2d",
    "BatchNorm",
    "LayerNorm",
    "Embedding",
    "Dropout",
    "Learner",
    "LearnerBuilder",
    "SupervisedTraining",
    "Adam",
    // PyTorch's ZeRO stage 1, named where bonfire's is compared with it.
    "ZeroRedundancyOptimizer",
    "AdamConfig",
    "Sgd",
    "SgdConfig",
    "Optimizer",
    "GradientsParams",
    "Gradients",
    "DistributedBackend",
    "DistributedParamId",
    "TransformerEncoder",
    "TransformerEncoderConfig",
    "TransformerEncoderInput",
    "TransformerEncoderLayer",
    "MultiHeadAttention",
    "RotaryEncoding",
    "CrossEntropyLoss",
    "CrossEntropyLossConfig",
    "RunningState",
    "Record",
    "Recorder",
    "CompactRecorder",
    "BinFileRecorder",
    "DataLoader",
    "Dataset",
    "Batcher",
    "ModuleMapper",
    "ModuleVisitor",
    "Ddp",
    "DistributedDataParallel",
    "DistributedSampler",
    "SyncBatchNorm",
    "DTensor",
    "Vec",
    "Result",
    "Option",
    "Some",
    "None",
    "Ok",
    "Err",
    "Box",
    "Arc",
    "String",
    "Duration",
    "PathBuf",
    "Path",
    "Error",
    "Send",
    "Sync",
    "Clone",
    "Default",
    "Debug",
    "Display",
    "Instant",
    "ExitCode",
    "Sequence",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
];

/// A user's own program in the examples of `bonfire launch`.
const USERS_PROGRAMS: &[&str] = &["train", "my-trainer", "my-training"];

/// Flags of other tools the docs show (cargo, mdbook, torchrun, the peers' scripts, apt).
const FOREIGN_FLAGS: &[&str] = &[
    // bonfire train's hidden flag for the ranks it starts, named in its error
    "resolved",
    // srun's
    "ntasks",
    "cpus-per-task",
    "release",
    "features",
    "no-default-features",
    "workspace",
    "locked",
    "version",
    "test",
    "lib",
    "doc",
    "nocapture",
    "exact",
    "ignored",
    "dest-dir",
    "root",
    "package",
    "bin",
    "example",
    "all-targets",
    "check",
    "manifest-path",
    "target-dir",
    "nproc_per_node",
    "nproc-per-node",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "rdzv-backend",
    "rdzv-endpoint",
    "rdzv_backend",
    "rdzv_endpoint",
    "max-restarts",
    "max_restarts",
    "standalone",
    "summary",
    "shm-size",
    "help",
    "model",
    "device",
    "steps",
    "batch",
    "epochs",
    "lntup",
];

/// One piece of code from a document: a fenced block's line or an inline span, and whether it
/// is Rust.
struct Snippet<'a> {
    text: &'a str,
    rust: bool,
    line: usize,
}

fn snippets(doc: &str) -> Vec<Snippet<'_>> {
    let inline = Regex::new(r"`([^`\n]+)`").unwrap();
    let mut out = Vec::new();
    let mut fence: Option<bool> = None;
    for (i, line) in doc.lines().enumerate() {
        let t = line.trim_start();
        if let Some(info) = t.strip_prefix("```") {
            fence = match fence {
                Some(_) => None,
                None => Some(info.starts_with("rust")),
            };
            continue;
        }
        match fence {
            Some(rust) => out.push(Snippet {
                text: line,
                rust,
                line: i + 1,
            }),
            None => {
                for c in inline.captures_iter(line) {
                    out.push(Snippet {
                        text: c.get(1).unwrap().as_str(),
                        rust: false,
                        line: i + 1,
                    });
                }
            }
        }
    }
    out
}

/// Every problem in `doc` (named `name`), as `name:line: what`.
fn check(name: &str, doc: &str, cli: &Cli, code: &Code, plain_help: bool) -> Vec<String> {
    let mut bad = Vec::new();
    let env = Regex::new(r"\bBONFIRE_[A-Z0-9_]*[A-Z0-9]\b").unwrap();
    let type_span = Regex::new(r"^[A-Za-z0-9_:<>, ()&'\[\];]+$").unwrap();
    let camel = Regex::new(r"\b[A-Z][A-Za-z0-9]*\b").unwrap();
    let item_path = Regex::new(r"\bbonfire::(?:[a-z_]+::)*([A-Za-z_][A-Za-z0-9_]*)").unwrap();
    let all_flags: BTreeSet<&String> = cli.flags.values().flatten().collect();
    let built = Regex::new(r"target/(?:release|debug)/((?:examples/)?[A-Za-z0-9_-]+)").unwrap();
    for (i, line) in doc.lines().enumerate() {
        for c in built.captures_iter(line) {
            let bin = &c[1];
            if !code.binaries.contains(bin) && !USERS_PROGRAMS.contains(&bin) {
                bad.push(format!(
                    "{name}:{}: target/.../{bin} is built by nothing here",
                    i + 1
                ));
            }
        }
        for m in env.find_iter(line) {
            if !code.literals.contains(&format!("\"{}\"", m.as_str())) {
                bad.push(format!(
                    "{name}:{}: {} is read nowhere in the code",
                    i + 1,
                    m.as_str()
                ));
            }
        }
    }
    let pieces: Vec<Snippet<'_>> = if plain_help {
        doc.lines()
            .enumerate()
            .map(|(i, l)| Snippet {
                text: l,
                rust: false,
                line: i + 1,
            })
            .collect()
    } else {
        snippets(doc)
    };
    for s in &pieces {
        let at = format!("{name}:{}", s.line);
        for c in item_path.captures_iter(s.text) {
            let item = &c[1];
            // Through a re-exported framework (`bonfire::kernels::cubecl::wgpu`): not ours.
            let through = ["::cubecl::", "::burn::"].iter().any(|f| c[0].contains(f));
            if !through && !code.items.contains(item) {
                bad.push(format!("{at}: bonfire::{item} is not defined"));
            }
        }
        if s.rust || plain_help {
            if plain_help {
                bad.extend(commands(&at, s.text, cli, &all_flags, true));
            }
            continue;
        }
        bad.extend(commands(&at, s.text, cli, &all_flags, false));
        let t = s.text.trim();
        if type_span.is_match(t) && t.chars().next().is_some_and(|c| c.is_ascii_uppercase()) {
            for w in camel.find_iter(t) {
                let w = w.as_str();
                // Capitalised words with a lower-case letter: `SHA256SUMS` is a file, `T` a
                // parameter.
                let camel = w.chars().any(|c| c.is_ascii_lowercase());
                if camel && !code.items.contains(w) && !FOREIGN_TYPES.contains(&w) {
                    bad.push(format!("{at}: type {w} is not defined"));
                }
            }
        }
        if let Some(flag) = t.strip_prefix("--") {
            let flag: String = flag
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            if !flag.is_empty()
                && !flag.starts_with('-')
                && !all_flags.contains(&flag)
                && !code.script_flags.contains(&flag)
                && !FOREIGN_FLAGS.contains(&flag.as_str())
            {
                bad.push(format!("{at}: --{flag} is a flag of no bonfire command"));
            }
        }
    }
    bad
}

/// The `bonfire` invocations in `text`: each command must exist and each flag after it must be
/// one of that command's (up to `--`, after which the flags are the launched program's).
fn commands(
    at: &str,
    text: &str,
    cli: &Cli,
    all_flags: &BTreeSet<&String>,
    help: bool,
) -> Vec<String> {
    let mut bad = Vec::new();
    let tokens: Vec<&str> = text.split_whitespace().collect();
    for (i, &tok) in tokens.iter().enumerate() {
        // `bonfire ...`, `target/release/bonfire ...`, `cargo run -p bonfire-cli -- ...`.
        let cargo_run =
            tok == "--" && tokens[..i].contains(&"bonfire-cli") && tokens[..i].contains(&"run");
        // A command starts its line or span (after `VAR=value` settings, or a shell's `&&`);
        // elsewhere "bonfire" is prose ("this bonfire was built without CUDA").
        let starts = tokens[..i]
            .iter()
            .rev()
            .take_while(|t| !matches!(**t, "&&" | ";" | "|" | "$"))
            .all(|t| t.contains('='));
        let binary = (tok == "bonfire" || tok.ends_with("/bonfire")) && starts;
        if !(binary || cargo_run) {
            continue;
        }
        let start = i + 1;
        let Some(&first) = tokens.get(start) else {
            continue;
        };
        // Prose in a help text or a code span: "bonfire is", "bonfire's".
        if !first.chars().all(|c| c.is_ascii_lowercase() || c == '-') || first.starts_with('-') {
            continue;
        }
        let mut path = vec![first];
        if !cli.flags.contains_key(first) {
            if help {
                continue;
            }
            bad.push(format!("{at}: `bonfire {first}` is not a command"));
            continue;
        }
        let mut next = start + 1;
        if let Some(&second) = tokens.get(next) {
            let key = format!("{first} {second}");
            let has_subs = cli
                .flags
                .keys()
                .any(|k| k.starts_with(&format!("{first} ")));
            if has_subs {
                if cli.flags.contains_key(&key) {
                    path.push(second);
                    next += 1;
                } else if second.chars().all(|c| c.is_ascii_lowercase()) && !help {
                    bad.push(format!("{at}: `bonfire {key}` is not a command"));
                    continue;
                }
            }
        }
        let flags = &cli.flags[&path.join(" ")];
        for &t in &tokens[next..] {
            // A new code span starts another command (`srun ... bonfire launch` in a message).
            if t == "--"
                || t.starts_with('|')
                || t == "&&"
                || t == ";"
                || t.starts_with('#')
                || t.starts_with('`')
            {
                break;
            }
            if let Some(f) = t.strip_prefix("--") {
                let f: String = f
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                let known = flags.contains(&f) || help && all_flags.contains(&f);
                if !f.is_empty() && !known {
                    bad.push(format!("{at}: `bonfire {}` has no --{f}", path.join(" ")));
                }
            }
        }
    }
    bad
}

#[test]
fn the_readme_the_book_and_the_help_name_only_what_exists() {
    let cli = cli();
    let code = code();
    assert!(cli.flags.contains_key("train vision") && cli.flags.contains_key("doctor"));
    let mut bad = Vec::new();
    let mut docs = vec![root().join("README.md")];
    let mut chapters: Vec<PathBuf> = std::fs::read_dir(root().join("book/src"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    chapters.sort();
    docs.extend(chapters);
    for d in &docs {
        let text = std::fs::read_to_string(d).unwrap();
        let name = d.strip_prefix(root()).unwrap().display().to_string();
        bad.extend(check(&name, &text, &cli, &code, false));
    }
    for (name, text) in &cli.helps {
        bad.extend(check(name, text, &cli, &code, true));
    }
    assert!(
        bad.is_empty(),
        "{} problems:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn the_check_finds_what_does_not_exist() {
    let cli = cli();
    let code = code();
    let doc = "Run `bonfire train vision --ranks 2 --turbo` or `bonfire serve`, set \
               `BONFIRE_WARP_DRIVE=1`, and use `bonfire::teleport()` with `Autodiff<Warp<Wgpu>>`.\n\
               \n```sh\nbonfire launch --nproc-per-node 2 -- ./trainer --turbo\nbonfire bench warp\n```\n\
               Flags alone: `--ranks` exists, `--frobnicate` does not.\n\
               Then `target/release/examples/mnist`.\n";
    let bad = check("doc.md", doc, &cli, &code, false);
    let expect = [
        "doc.md:1: `bonfire train vision` has no --turbo",
        "doc.md:1: `bonfire serve` is not a command",
        "doc.md:1: BONFIRE_WARP_DRIVE is read nowhere in the code",
        "doc.md:1: bonfire::teleport is not defined",
        "doc.md:1: type Warp is not defined",
        "doc.md:5: `bonfire bench warp` is not a command",
        "doc.md:7: --frobnicate is a flag of no bonfire command",
        "doc.md:8: target/.../examples/mnist is built by nothing here",
    ];
    for e in expect {
        assert!(bad.iter().any(|b| b == e), "missed {e:?} in {bad:#?}");
    }
    assert_eq!(bad.len(), expect.len(), "{bad:#?}");
}
