//! Exposes the resolved nexar version (read from this project's Cargo.lock) as `NEXAR_VERSION`.

use std::{env, fs, path::Path};

fn main() {
    let lock = Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap()).join("Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock.display());
    let text = fs::read_to_string(&lock).unwrap_or_default();
    let mut lines = text.lines();
    let version = loop {
        match lines.next() {
            Some("name = \"nexar\"") => {
                let line = lines.next().unwrap_or_default();
                break line
                    .trim_start_matches("version = ")
                    .trim_matches('"')
                    .to_string();
            }
            Some(_) => {}
            None => break "unknown".to_string(),
        }
    };
    println!("cargo:rustc-env=NEXAR_VERSION={version}");
}
