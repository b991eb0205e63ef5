//! The layer arrows of ../shared/design/architecture.md, checked on the real manifests: a crate
//! low in the stack must not depend (outside dev-dependencies) on anything above it.

use std::process::Command;

/// (crate, forbidden dependency prefixes). A prefix ending in `-` matches by prefix, any other
/// matches the name or the name followed by `-`.
const RULES: &[(&str, &[&str])] = &[
    (
        "bonfire-topology",
        &["burn", "cubecl", "quinn", "tokio", "bonfire-"],
    ),
    (
        "bonfire-transport",
        &[
            "burn",
            "cubecl",
            "bonfire-collectives",
            "bonfire-kernels",
            "bonfire-backend",
        ],
    ),
    (
        "bonfire-collectives",
        &["burn", "cubecl", "bonfire-kernels", "bonfire-backend"],
    ),
    (
        "bonfire-launch",
        &[
            "burn",
            "cubecl",
            "bonfire-collectives",
            "bonfire-kernels",
            "bonfire-backend",
        ],
    ),
    (
        "bonfire-kernels",
        &[
            "burn",
            "quinn",
            "tokio",
            "bonfire-transport",
            "bonfire-collectives",
            "bonfire-backend",
        ],
    ),
    (
        "bonfire-backend",
        &[
            "quinn",
            "bonfire-launch",
            "bonfire-cli",
            "bonfire-testkit",
            "bonfire-train",
        ],
    ),
    (
        "bonfire-train",
        &["quinn", "bonfire-launch", "bonfire-cli", "bonfire-testkit"],
    ),
    // The bundled models do not know they are distributed; the data sets know only the pure
    // vocabulary (bonfire-topology's one rule for which items each rank reads, see ALLOWED).
    ("bonfire-models", &["bonfire-", "quinn", "tokio", "cubecl"]),
    (
        "bonfire-datasets",
        &["bonfire-", "quinn", "tokio", "cubecl"],
    ),
    // The job library sits under the command, never the other way round.
    ("bonfire-jobs", &["bonfire-cli"]),
];

/// (crate, dependencies allowed although a rule above matches them).
const ALLOWED: &[(&str, &[&str])] = &[("bonfire-datasets", &["bonfire-topology"])];

/// Whether `own` may not depend on `dep`: a rule matches it and no exception names it.
fn breaks_layers(own: &str, dep: &str, rules: &[&str]) -> bool {
    let allowed = ALLOWED
        .iter()
        .any(|(c, deps)| *c == own && deps.contains(&dep));
    !allowed && rules.iter().any(|r| forbidden(dep, r, own))
}

fn forbidden(dep: &str, rule: &str, own: &str) -> bool {
    if dep == own {
        return false;
    }
    if rule.ends_with('-') {
        dep.starts_with(rule)
    } else {
        dep == rule || dep.starts_with(&format!("{rule}-"))
    }
}

#[test]
fn lower_layers_do_not_depend_on_higher_ones() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let names: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    for required in [
        "bonfire-topology",
        "bonfire-transport",
        "bonfire-collectives",
        "bonfire-launch",
        "bonfire-jobs",
    ] {
        assert!(
            names.contains(&required),
            "{required} is missing from the workspace"
        );
    }
    let mut broken = Vec::new();
    for p in packages {
        let own = p["name"].as_str().expect("name");
        let Some((_, rules)) = RULES.iter().find(|(c, _)| *c == own) else {
            continue;
        };
        for d in p["dependencies"].as_array().expect("dependencies") {
            if d["kind"].as_str() == Some("dev") {
                continue;
            }
            let dep = d["name"].as_str().expect("dependency name");
            if breaks_layers(own, dep, rules) {
                broken.push(format!("{own} depends on {dep}"));
            }
        }
    }
    assert!(broken.is_empty(), "layer arrows broken: {broken:?}");
}

#[test]
fn exceptions_allow_only_what_they_name() {
    let datasets = RULES
        .iter()
        .find(|(c, _)| *c == "bonfire-datasets")
        .expect("a rule for bonfire-datasets")
        .1;
    assert!(!breaks_layers(
        "bonfire-datasets",
        "bonfire-topology",
        datasets
    ));
    assert!(breaks_layers(
        "bonfire-datasets",
        "bonfire-backend",
        datasets
    ));
    assert!(breaks_layers(
        "bonfire-datasets",
        "bonfire-transport",
        datasets
    ));
    let models = RULES
        .iter()
        .find(|(c, _)| *c == "bonfire-models")
        .expect("a rule for bonfire-models")
        .1;
    assert!(breaks_layers("bonfire-models", "bonfire-topology", models));
    let jobs = RULES
        .iter()
        .find(|(c, _)| *c == "bonfire-jobs")
        .expect("a rule for bonfire-jobs")
        .1;
    assert!(breaks_layers("bonfire-jobs", "bonfire-cli", jobs));
    assert!(!breaks_layers("bonfire-jobs", "bonfire", jobs));
}

#[test]
fn the_rule_matcher_matches_what_it_should() {
    assert!(forbidden("burn-tensor", "burn", "x"));
    assert!(forbidden("burn", "burn", "x"));
    assert!(!forbidden("burnish", "burn", "x"));
    assert!(forbidden(
        "bonfire-transport",
        "bonfire-",
        "bonfire-topology"
    ));
    assert!(!forbidden(
        "bonfire-topology",
        "bonfire-",
        "bonfire-topology"
    ));
}
