//! Line plots as PNG files, drawn with `plotters` on a pixel buffer in DejaVu Sans, which is
//! compiled in (no system fonts needed): axes with their labels, a light grid, a title, a legend,
//! and a logarithmic vertical axis on request.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

/// One series: its name in the legend, its colour, and its points (x, y).
#[derive(Clone, Copy, Debug)]
pub struct Series<'a> {
    /// Its name in the legend.
    pub name: &'a str,
    /// Its colour, RGB.
    pub colour: [u8; 3],
    /// Its points, (x, y); points that are not finite (or not positive, on a log scale) are
    /// left out.
    pub points: &'a [(f64, f64)],
    /// Draw a dot at each point (for sparse series such as per-epoch test figures).
    pub dots: bool,
}

/// What a plot shows besides its series.
#[derive(Clone, Copy, Debug)]
pub struct Axes<'a> {
    /// The title, lower-case (`loss`).
    pub title: &'a str,
    /// The horizontal axis' label (`epoch`).
    pub x: &'a str,
    /// The vertical axis' label (`cross-entropy (nats)`).
    pub y: &'a str,
    /// Fixes the vertical axis; otherwise it spans the data.
    pub y_range: Option<(f64, f64)>,
    /// A logarithmic vertical axis.
    pub log_y: bool,
}

const W: u32 = 720;
const H: u32 = 440;
const FONT: &str = "bonfire-sans";
static DEJAVU_SANS: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

fn font() -> &'static str {
    static REGISTERED: OnceLock<()> = OnceLock::new();
    REGISTERED.get_or_init(|| {
        // The font is compiled in and parses; a failure here is a broken build.
        plotters::style::register_font(FONT, FontStyle::Normal, DEJAVU_SANS)
            .unwrap_or_else(|_| panic!("the embedded DejaVu Sans does not parse"));
    });
    FONT
}

/// The data's extent: x and y ranges, padded, never empty.
fn extent(series: &[Series<'_>], axes: &Axes<'_>) -> ((f64, f64), (f64, f64)) {
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|&p| keep(p, axes.log_y))
        .collect();
    let fold = |f: fn(&(f64, f64)) -> f64| {
        all.iter()
            .map(f)
            .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)))
    };
    let (mut x0, mut x1) = if all.is_empty() {
        (0.0, 1.0)
    } else {
        fold(|p| p.0)
    };
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let (mut y0, mut y1) = match axes.y_range {
        Some(r) => r,
        None if all.is_empty() => (0.1, 1.0),
        None => fold(|p| p.1),
    };
    if axes.log_y {
        if axes.y_range.is_none() {
            (y0, y1) = (y0 / 1.25, y1 * 1.25);
        }
        if y1 <= y0 {
            y1 = y0 * 10.0;
        }
    } else {
        if y1 <= y0 {
            (y0, y1) = (y0 - 0.5, y1 + 0.5);
        }
        if axes.y_range.is_none() {
            let pad = 0.05 * (y1 - y0);
            (y0, y1) = (
                if y0 >= 0.0 {
                    (y0 - pad).max(0.0)
                } else {
                    y0 - pad
                },
                y1 + pad,
            );
        }
    }
    x0 = x0.min(x1 - f64::EPSILON);
    ((x0, x1), (y0, y1))
}

fn keep((x, y): (f64, f64), log_y: bool) -> bool {
    x.is_finite() && y.is_finite() && (!log_y || y > 0.0)
}

/// Draws `series` against shared axes and writes a PNG to `path` (through a temporary file and a
/// rename).
pub fn line_plot(path: &Path, axes: &Axes<'_>, series: &[Series<'_>]) -> std::io::Result<()> {
    let (xr, yr) = extent(series, axes);
    let mut px = vec![255u8; (W * H * 3) as usize];
    draw(&mut px, axes, series, xr, yr)
        .map_err(|e| std::io::Error::other(format!("drawing {}: {e}", path.display())))?;
    let tmp = path.with_extension("png.tmp");
    {
        let file = std::fs::File::create(&tmp)?;
        let mut enc = png::Encoder::new(std::io::BufWriter::new(file), W, H);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().map_err(std::io::Error::other)?;
        w.write_image_data(&px).map_err(std::io::Error::other)?;
        w.finish().map_err(std::io::Error::other)?;
    }
    std::fs::rename(tmp, path)
}

/// On a log scale the vertical axis is drawn in `ln y` and labelled with `y`: plotters' own
/// logarithmic axis labels only powers of ten, and a loss curve often spans less than one.
fn draw(
    px: &mut [u8],
    axes: &Axes<'_>,
    series: &[Series<'_>],
    (x0, x1): (f64, f64),
    (y0, y1): (f64, f64),
) -> Result<(), Box<dyn std::error::Error + 'static>> {
    let log = axes.log_y;
    let to_axis = |y: f64| if log { y.ln() } else { y };
    let family = font();
    let root = BitMapBackend::with_buffer(px, (W, H)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let y_desc = if log {
        format!("{} (log scale)", axes.y)
    } else {
        axes.y.to_string()
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(axes.title, (family, 22))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, to_axis(y0)..to_axis(y1))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(axes.x)
        .y_desc(y_desc)
        .label_style((family, 13))
        .axis_desc_style((family, 15))
        .light_line_style(RGBColor(238, 238, 238))
        .bold_line_style(RGBColor(215, 215, 215))
        .x_labels(8)
        .y_labels(8)
        .y_label_formatter(&|v: &f64| {
            let y = if log { v.exp() } else { *v };
            format!("{}", Significant(y))
        })
        .draw()
        .map_err(|e| e.to_string())?;
    for s in series {
        let colour = RGBColor(s.colour[0], s.colour[1], s.colour[2]);
        let points: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(|&p| keep(p, axes.log_y))
            .map(|(x, y)| (x, to_axis(y)))
            .collect();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                colour.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?
            .label(s.name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(3))
            });
        if s.dots {
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 3, colour.filled())))
                .map_err(|e| e.to_string())?;
        }
    }
    chart
        .configure_series_labels()
        .label_font((family, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(200, 200, 200))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

/// A tick label: three significant digits, without trailing zeros (`0.25`, `2.31`, `100`).
struct Significant(f64);

impl std::fmt::Display for Significant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.0;
        if v == 0.0 || !v.is_finite() {
            return write!(f, "{v}");
        }
        let digits = (2 - v.abs().log10().floor() as i32).max(0) as usize;
        let text = format!("{v:.digits$}");
        let text = if text.contains('.') {
            text.trim_end_matches('0').trim_end_matches('.')
        } else {
            &text
        };
        write!(f, "{text}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(path: &Path) -> Vec<u8> {
        let decoder =
            png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (W, H));
        buf
    }

    fn count(buf: &[u8], colour: [u8; 3]) -> usize {
        buf.chunks(3).filter(|p| *p == colour).count()
    }

    /// Pixels of text or axes: dark grey to black.
    fn ink(buf: &[u8], rows: std::ops::Range<u32>) -> usize {
        let row = (W * 3) as usize;
        buf[rows.start as usize * row..rows.end as usize * row]
            .chunks(3)
            .filter(|p| p.iter().all(|&c| c < 100))
            .count()
    }

    #[test]
    fn a_plot_is_a_png_with_the_series_title_and_labels_drawn() {
        let dir = std::env::temp_dir().join(format!("bonfire-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("loss.png");
        let pts = [(0.0, 2.3), (0.5, 0.4), (1.0, 0.2), (2.0, 0.1)];
        let red = [200, 30, 30];
        let series = [Series {
            name: "train",
            colour: red,
            points: &pts,
            dots: false,
        }];
        let mut axes = Axes {
            title: "loss",
            x: "epoch",
            y: "cross-entropy",
            y_range: None,
            log_y: false,
        };
        line_plot(&path, &axes, &series).unwrap();
        let linear = read(&path);
        assert!(
            count(&linear, red) > 500,
            "{} red pixels",
            count(&linear, red)
        );
        // The title is drawn in the top band, in the embedded font.
        assert!(
            ink(&linear, 0..40) > 50,
            "{} dark pixels in the title band",
            ink(&linear, 0..40)
        );
        // The x label sits below the axis.
        assert!(ink(&linear, H - 24..H) > 30);

        axes.log_y = true;
        line_plot(&path, &axes, &series).unwrap();
        let log = read(&path);
        assert!(count(&log, red) > 500);
        assert_ne!(linear, log, "a log scale draws another picture");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tick_labels_have_three_significant_digits() {
        let f = |v: f64| Significant(v).to_string();
        assert_eq!(
            [
                f(0.25),
                f(2.3125),
                f(100.0),
                f(0.0123456),
                f(1850.0),
                f(0.0)
            ],
            ["0.25", "2.31", "100", "0.0123", "1850", "0"]
        );
    }

    #[test]
    fn a_log_scale_leaves_out_points_it_cannot_draw() {
        let axes = Axes {
            title: "loss",
            x: "step",
            y: "loss",
            y_range: None,
            log_y: true,
        };
        let pts = [(0.0, 0.0), (1.0, 1.0), (2.0, 0.01), (3.0, f64::NAN)];
        let s = [Series {
            name: "a",
            colour: [0, 0, 0],
            points: &pts,
            dots: true,
        }];
        let ((x0, x1), (y0, y1)) = extent(&s, &axes);
        assert_eq!((x0, x1), (1.0, 2.0));
        assert!(y0 > 0.0 && y0 < 0.01 && y1 > 1.0, "{y0}..{y1}");
    }

    #[test]
    fn an_empty_plot_still_draws() {
        let dir = std::env::temp_dir().join(format!("bonfire-plot-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("accuracy.png");
        let axes = Axes {
            title: "accuracy",
            x: "epoch",
            y: "accuracy (%)",
            y_range: Some((90.0, 100.0)),
            log_y: false,
        };
        line_plot(&path, &axes, &[]).unwrap();
        assert!(path.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
