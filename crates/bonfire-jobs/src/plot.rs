//! Line plots as PNG files, drawn on a pixel buffer with a small built-in font (no system fonts,
//! no plotting library): axes, a light grid, tick labels, a title and a legend.

use std::path::Path;

/// One series: its name in the legend, its colour, and its points (x, y).
#[derive(Clone, Copy, Debug)]
pub struct Series<'a> {
    /// Its name in the legend.
    pub name: &'a str,
    /// Its colour, RGB.
    pub colour: [u8; 3],
    /// Its points, (x, y); points that are not finite are left out.
    pub points: &'a [(f64, f64)],
    /// Draw a dot at each point (for sparse series such as per-epoch test figures).
    pub dots: bool,
}

const W: usize = 640;
const H: usize = 400;
const LEFT: usize = 70;
const RIGHT: usize = 20;
const TOP: usize = 40;
const BOTTOM: usize = 50;

struct Canvas {
    px: Vec<u8>,
}

impl Canvas {
    fn new() -> Canvas {
        Canvas {
            px: vec![255; W * H * 3],
        }
    }

    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < W && (y as usize) < H {
            let i = (y as usize * W + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), c: [u8; 3], thick: i64) {
        let steps = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as i64).max(1);
        for s in 0..=steps {
            let t = s as f64 / steps as f64;
            let (x, y) = (x0 + t * (x1 - x0), y0 + t * (y1 - y0));
            for dx in 0..thick {
                for dy in 0..thick {
                    self.set(
                        x.round() as i64 + dx - thick / 2,
                        y.round() as i64 + dy - thick / 2,
                        c,
                    );
                }
            }
        }
    }

    /// Text with its top-left corner at (x, y), each font pixel `scale` pixels wide.
    fn text(&mut self, x: i64, y: i64, s: &str, c: [u8; 3], scale: i64) {
        for (k, ch) in s.chars().enumerate() {
            let rows = glyph(ch);
            for (r, bits) in rows.iter().enumerate() {
                for col in 0..5 {
                    if bits & (0b10000 >> col) != 0 {
                        for dx in 0..scale {
                            for dy in 0..scale {
                                self.set(
                                    x + (k as i64 * 6 + col) * scale + dx,
                                    y + r as i64 * scale + dy,
                                    c,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

fn text_width(s: &str, scale: i64) -> i64 {
    s.chars().count() as i64 * 6 * scale
}

/// A 5x7 font for the characters the plots use (upper-case letters, digits, a few signs); lower
/// case is drawn as upper case, anything else as a blank.
fn glyph(c: char) -> [u8; 7] {
    match c.to_ascii_uppercase() {
        '0' => [14, 17, 19, 21, 25, 17, 14],
        '1' => [4, 12, 4, 4, 4, 4, 14],
        '2' => [14, 17, 1, 2, 4, 8, 31],
        '3' => [31, 2, 4, 2, 1, 17, 14],
        '4' => [2, 6, 10, 18, 31, 2, 2],
        '5' => [31, 16, 30, 1, 1, 17, 14],
        '6' => [6, 8, 16, 30, 17, 17, 14],
        '7' => [31, 1, 2, 4, 8, 8, 8],
        '8' => [14, 17, 17, 14, 17, 17, 14],
        '9' => [14, 17, 17, 15, 1, 2, 12],
        '.' => [0, 0, 0, 0, 0, 12, 12],
        '%' => [24, 25, 2, 4, 8, 19, 3],
        '-' => [0, 0, 0, 31, 0, 0, 0],
        '(' => [2, 4, 8, 8, 8, 4, 2],
        ')' => [8, 4, 2, 2, 2, 4, 8],
        ',' => [0, 0, 0, 0, 12, 4, 8],
        ':' => [0, 12, 12, 0, 12, 12, 0],
        '/' => [1, 1, 2, 4, 8, 16, 16],
        'A' => [14, 17, 17, 31, 17, 17, 17],
        'B' => [30, 17, 17, 30, 17, 17, 30],
        'C' => [14, 17, 16, 16, 16, 17, 14],
        'D' => [28, 18, 17, 17, 17, 18, 28],
        'E' => [31, 16, 16, 30, 16, 16, 31],
        'F' => [31, 16, 16, 30, 16, 16, 16],
        'G' => [14, 17, 16, 23, 17, 17, 15],
        'H' => [17, 17, 17, 31, 17, 17, 17],
        'I' => [14, 4, 4, 4, 4, 4, 14],
        'J' => [7, 2, 2, 2, 2, 18, 12],
        'K' => [17, 18, 20, 24, 20, 18, 17],
        'L' => [16, 16, 16, 16, 16, 16, 31],
        'M' => [17, 27, 21, 21, 17, 17, 17],
        'N' => [17, 17, 25, 21, 19, 17, 17],
        'O' => [14, 17, 17, 17, 17, 17, 14],
        'P' => [30, 17, 17, 30, 16, 16, 16],
        'Q' => [14, 17, 17, 17, 21, 18, 13],
        'R' => [30, 17, 17, 30, 20, 18, 17],
        'S' => [15, 16, 16, 14, 1, 1, 30],
        'T' => [31, 4, 4, 4, 4, 4, 4],
        'U' => [17, 17, 17, 17, 17, 17, 14],
        'V' => [17, 17, 17, 17, 17, 10, 4],
        'W' => [17, 17, 17, 21, 21, 21, 10],
        'X' => [17, 17, 10, 4, 10, 17, 17],
        'Y' => [17, 17, 17, 10, 4, 4, 4],
        'Z' => [31, 1, 2, 4, 8, 16, 31],
        _ => [0; 7],
    }
}

/// Round numbers for an axis from `lo` to `hi`: about five ticks at 1, 2 or 5 times a power of ten.
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / 5.0;
    let p = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|s| span / s <= 6.0)
        .unwrap_or(10.0 * p);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 {
        out.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        t += step;
    }
    out
}

fn label(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10()).ceil() as usize
    };
    format!("{v:.decimals$}")
}

/// Draws `series` against shared axes and writes a PNG to `path` (through a temporary file and a
/// rename). `y_range` fixes the vertical axis; otherwise it spans the data.
pub fn line_plot(
    path: &Path,
    title: &str,
    x_label: &str,
    series: &[Series<'_>],
    y_range: Option<(f64, f64)>,
) -> std::io::Result<()> {
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let (mut x0, mut x1) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (mut y0, mut y1) = y_range.unwrap_or_else(|| {
        all.iter()
            .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)))
    });
    if all.is_empty() {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        (y0, y1) = (y0 - 0.5, y1 + 0.5);
    }
    if y_range.is_none() {
        let pad = 0.05 * (y1 - y0);
        (y0, y1) = (
            (y0 - pad).max(if y0 >= 0.0 { 0.0 } else { f64::MIN }),
            y1 + pad,
        );
    }
    let (pw, ph) = ((W - LEFT - RIGHT) as f64, (H - TOP - BOTTOM) as f64);
    let sx = |x: f64| LEFT as f64 + (x - x0) / (x1 - x0) * pw;
    let sy = |y: f64| TOP as f64 + (1.0 - (y - y0) / (y1 - y0)) * ph;
    let mut c = Canvas::new();
    let grey = [225, 225, 225];
    let ink = [40, 40, 40];
    let xt = ticks(x0, x1);
    let yt = ticks(y0, y1);
    let xs = if xt.len() > 1 { xt[1] - xt[0] } else { 1.0 };
    let ys = if yt.len() > 1 { yt[1] - yt[0] } else { 1.0 };
    for &t in &xt {
        c.line((sx(t), TOP as f64), (sx(t), (H - BOTTOM) as f64), grey, 1);
        let l = label(t, xs);
        c.text(
            sx(t) as i64 - text_width(&l, 1) / 2,
            (H - BOTTOM + 6) as i64,
            &l,
            ink,
            1,
        );
    }
    for &t in &yt {
        c.line((LEFT as f64, sy(t)), ((W - RIGHT) as f64, sy(t)), grey, 1);
        let l = label(t, ys);
        c.text(
            LEFT as i64 - 6 - text_width(&l, 1),
            sy(t) as i64 - 3,
            &l,
            ink,
            1,
        );
    }
    c.line(
        (LEFT as f64, TOP as f64),
        (LEFT as f64, (H - BOTTOM) as f64),
        ink,
        1,
    );
    c.line(
        (LEFT as f64, (H - BOTTOM) as f64),
        ((W - RIGHT) as f64, (H - BOTTOM) as f64),
        ink,
        1,
    );
    c.text((W as i64 - text_width(title, 2)) / 2, 12, title, ink, 2);
    c.text(
        LEFT as i64 + (pw as i64 - text_width(x_label, 1)) / 2,
        (H - 20) as i64,
        x_label,
        ink,
        1,
    );
    let mut legend_y = TOP as i64 + 8;
    for s in series {
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|&(x, y)| (sx(x), sy(y.clamp(y0, y1))))
            .collect();
        for w in pts.windows(2) {
            c.line(w[0], w[1], s.colour, 2);
        }
        if s.dots || pts.len() == 1 {
            for &(x, y) in &pts {
                for dx in -3..=3 {
                    for dy in -3..=3 {
                        if dx * dx + dy * dy <= 9 {
                            c.set(x as i64 + dx, y as i64 + dy, s.colour);
                        }
                    }
                }
            }
        }
        let lx = (W - RIGHT) as i64 - 12 - text_width(s.name, 1) - 22;
        c.line(
            (lx as f64, legend_y as f64 + 3.0),
            (lx as f64 + 16.0, legend_y as f64 + 3.0),
            s.colour,
            3,
        );
        c.text(lx + 22, legend_y, s.name, ink, 1);
        legend_y += 14;
    }
    let tmp = path.with_extension("png.tmp");
    {
        let file = std::fs::File::create(&tmp)?;
        let mut enc = png::Encoder::new(std::io::BufWriter::new(file), W as u32, H as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().map_err(std::io::Error::other)?;
        w.write_image_data(&c.px).map_err(std::io::Error::other)?;
        w.finish().map_err(std::io::Error::other)?;
    }
    std::fs::rename(tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(
            ticks(0.0, 1.0),
            vec![0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]
        );
        let t = ticks(1.0, 4.0);
        assert_eq!(
            t,
            vec![1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0][..t.len()].to_vec()
        );
        assert_eq!(label(0.25, 0.05), "0.25");
        assert_eq!(label(3.0, 1.0), "3");
    }

    #[test]
    fn a_plot_is_a_png_with_the_series_drawn() {
        let dir = std::env::temp_dir().join(format!("bonfire-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("loss.png");
        let pts = [(0.0, 2.3), (0.5, 0.4), (1.0, 0.2), (2.0, 0.1)];
        let red = [200, 30, 30];
        line_plot(
            &path,
            "Loss",
            "epoch",
            &[Series {
                name: "train",
                colour: red,
                points: &pts,
                dots: false,
            }],
            None,
        )
        .unwrap();
        let decoder =
            png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&path).unwrap()));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (W as u32, H as u32));
        let reds = buf.chunks(3).filter(|p| *p == red).count();
        assert!(reds > 500, "{reds} red pixels");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
