//! PNG charts of a report: for each trained (model, batch, dtype) and each
//! attention shape, three panels against the sequence length (throughput,
//! peak memory, time), one line per implementation, PyTorch's included.
//! An implementation that failed at some length (out of memory) says so in
//! the legend, where its line ends.
//!
//! Text is drawn with a TrueType font read from the machine at run time
//! (`BASTILE_CHART_FONT`, or a DejaVu / Liberation / Arial file at the usual
//! places), so no font library has to be installed to build. Charts are
//! drawn into memory and written with the `png` crate (0.16, whose
//! compressor shares no crate with Burn's dependency tree: a newer one
//! would change the features of crates Burn builds, and rebuild it).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::report::Report;
use bastile_cli::device::CudaBackend;

/// One line of a panel.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    /// `(sequence length, value)`, by length.
    pub points: Vec<(usize, f64)>,
    /// The first length it failed at, and why (short).
    pub failed: Option<(usize, String)>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    pub title: &'static str,
    pub y_label: &'static str,
    pub series: Vec<Series>,
}

/// One PNG: a title and three panels side by side.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    pub title: String,
    /// Appended to the results file's stem: `<stem>-<suffix>.png`.
    pub suffix: String,
    pub panels: Vec<Panel>,
}

/// The figures `report` holds data for.
pub fn figures(report: &Report) -> Vec<Figure> {
    let mut out = Vec::new();
    let mut groups: Vec<(&str, usize, &str)> = Vec::new();
    for r in &report.train {
        let key = (r.model.as_str(), r.batch, r.dtype.as_str());
        if !groups.contains(&key) {
            groups.push(key);
        }
    }
    for (model, batch, dtype) in groups {
        let rows: Vec<_> = report
            .train
            .iter()
            .filter(|r| r.model == model && r.batch == batch && r.dtype == dtype)
            .collect();
        let panel = |title, y_label, value: &dyn Fn(&crate::train::TrainRow) -> Option<f64>| {
            let mut series: Vec<Series> = Vec::new();
            for r in &rows {
                record(
                    &mut series,
                    &r.implementation,
                    r.seq,
                    value(r),
                    r.error.as_deref(),
                );
            }
            finish(title, y_label, series)
        };
        out.push(Figure {
            title: format!(
                "{model}, batch {batch}, {dtype} training step · {}",
                device(report)
            ),
            suffix: format!("train-{}-b{batch}", file_safe(model)),
            panels: vec![
                panel("Throughput", "thousand tokens / s", &|r| {
                    r.tokens_per_s.map(|t| t / 1e3)
                }),
                panel("Peak memory", "GiB reserved", &|r| {
                    r.peak_mib.map(|m| m / 1024.0)
                }),
                panel("Latency", "ms / step", &|r| r.ms_per_step),
            ],
        });
    }
    let mut shapes: Vec<(&str, &str)> = Vec::new();
    for r in &report.attention {
        if !shapes.contains(&(r.shape.as_str(), r.dtype.as_str())) {
            shapes.push((r.shape.as_str(), r.dtype.as_str()));
        }
    }
    for (i, (shape, dtype)) in shapes.iter().enumerate() {
        let rows: Vec<_> = report
            .attention
            .iter()
            .filter(|r| r.shape == *shape && r.dtype == *dtype)
            .collect();
        let panel = |title, y_label, value: &dyn Fn(&crate::report::AttentionRow) -> f64| {
            let mut series: Vec<Series> = Vec::new();
            for r in &rows {
                let point = r.error.is_none().then(|| value(r));
                record(
                    &mut series,
                    &r.implementation,
                    r.seq,
                    point,
                    r.error.as_deref(),
                );
            }
            finish(title, y_label, series)
        };
        out.push(Figure {
            title: format!(
                "attention {shape}, {dtype}, forward + backward · {}",
                device(report)
            ),
            suffix: if shapes.len() == 1 {
                "attention".into()
            } else {
                format!("attention-{i}")
            },
            panels: vec![
                panel("Throughput", "TFLOP/s (causal)", &|r| r.fwd_bwd_tflops),
                panel("Peak memory", "GiB reserved", &|r| r.peak_mib / 1024.0),
                panel("Latency", "ms", &|r| r.fwd_bwd_ms),
            ],
        });
    }
    out
}

/// The device as a title names it; tiny runs say they are not performance
/// numbers.
fn device(report: &Report) -> String {
    if report.tiny {
        format!(
            "{} (tiny shapes: a functional run, not performance numbers)",
            report.device
        )
    } else {
        report.device.clone()
    }
}

/// Adds one measurement to the line of `name`: a point, or (the first time
/// it failed) where the line ends and why.
fn record(
    series: &mut Vec<Series>,
    name: &str,
    seq: usize,
    value: Option<f64>,
    error: Option<&str>,
) {
    let i = match series.iter().position(|s| s.name == name) {
        Some(i) => i,
        None => {
            series.push(Series {
                name: name.into(),
                points: Vec::new(),
                failed: None,
            });
            series.len() - 1
        }
    };
    let s = &mut series[i];
    match (value, error) {
        (Some(v), _) => s.points.push((seq, v)),
        (None, Some(e)) if s.failed.is_none() => {
            s.failed = Some((seq, crate::train::failure_label(e).into()))
        }
        _ => {}
    }
}

fn finish(title: &'static str, y_label: &'static str, mut series: Vec<Series>) -> Panel {
    for s in &mut series {
        s.points.sort_by_key(|p| p.0);
    }
    Panel {
        title,
        y_label,
        series,
    }
}

fn file_safe(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Draws every figure of `report` beside `results` (`<stem>-<suffix>.png`).
pub fn draw_all(report: &Report, results: &Path) -> Result<Vec<PathBuf>, String> {
    let figures = figures(report);
    if figures.is_empty() {
        return Ok(Vec::new());
    }
    load_font()?;
    let stem = results
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "results".into());
    let mut written = Vec::new();
    for fig in &figures {
        let path = results.with_file_name(format!("{stem}-{}.png", fig.suffix));
        draw(fig, &path).map_err(|e| format!("{}: {e}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// The font's bytes live as long as the process: plotters keeps a
/// reference.
fn load_font() -> Result<(), String> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let mut candidates: Vec<PathBuf> = std::env::var_os("BASTILE_CHART_FONT")
                .map(PathBuf::from)
                .into_iter()
                .collect();
            candidates.extend(
                [
                    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
                    "/usr/share/fonts/TTF/DejaVuSans.ttf",
                    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
                    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
                    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
                    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
                    "/System/Library/Fonts/Supplemental/Arial.ttf",
                    "C:\\Windows\\Fonts\\arial.ttf",
                ]
                .map(PathBuf::from),
            );
            let (path, bytes) = candidates
                .iter()
                .find_map(|p| std::fs::read(p).ok().map(|b| (p, b)))
                .ok_or_else(|| {
                    "no TrueType font found: set BASTILE_CHART_FONT to a .ttf file, or install \
                     one (Debian/Ubuntu: fonts-dejavu-core)"
                        .to_string()
                })?;
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{} is not a TrueType font", path.display()))
        })
        .clone()
}

/// Colours by implementation (whatever CUDA backend its row names), the
/// same in every chart.
fn colour(name: &str, index: usize) -> RGBColor {
    let backends = [CudaBackend::Direct, CudaBackend::Fusion].map(CudaBackend::name);
    let name = name
        .split(", ")
        .filter(|part| !backends.contains(part))
        .collect::<Vec<_>>()
        .join(", ");
    match name.as_str() {
        "bastile" => RGBColor(214, 69, 65),
        "burn" => RGBColor(52, 101, 164),
        "bastile (Burn matmul)" => RGBColor(245, 166, 35),
        // "HF transformers", or with a forced attention "(eager)".
        n if n.starts_with("HF transformers") => RGBColor(110, 110, 110),
        "HF + Liger-Kernel" => RGBColor(46, 160, 67),
        "torch sdpa" => RGBColor(142, 68, 173),
        _ => {
            let c = Palette99::pick(index + 3).to_rgba();
            RGBColor(c.0, c.1, c.2)
        }
    }
}

/// Chart size in pixels.
const SIZE: (u32, u32) = (1650, 520);

fn draw(fig: &Figure, path: &Path) -> Result<(), String> {
    let mut rgb = vec![0u8; (SIZE.0 * SIZE.1 * 3) as usize];
    render(fig, &mut rgb)?;
    let file = std::fs::File::create(path).map_err(|e| e.to_string())?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), SIZE.0, SIZE.1);
    encoder.set_color(png::ColorType::RGB);
    encoder.set_depth(png::BitDepth::Eight);
    encoder
        .write_header()
        .and_then(|mut w| w.write_image_data(&rgb))
        .map_err(|e| e.to_string())
}

fn render(fig: &Figure, rgb: &mut [u8]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let root = BitMapBackend::with_buffer(rgb, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let body = root
        .titled(&fig.title, ("sans-serif", 24))
        .map_err(|e| err(&e))?;
    let areas = body.split_evenly((1, fig.panels.len()));
    for (k, (area, panel)) in areas.iter().zip(&fig.panels).enumerate() {
        let points = panel.series.iter().flat_map(|s| s.points.iter());
        let (lo, hi) = points
            .clone()
            .map(|p| p.0)
            .fold((usize::MAX, 0), |(lo, hi), s| (lo.min(s), hi.max(s)));
        let failed_at = panel
            .series
            .iter()
            .filter_map(|s| s.failed.as_ref().map(|f| f.0));
        let (lo, hi) = failed_at.fold((lo, hi), |(lo, hi), s| (lo.min(s), hi.max(s)));
        if hi == 0 {
            continue;
        }
        let ymax = points.map(|p| p.1).fold(0.0_f64, f64::max).max(1e-9) * 1.15;
        // The x axis is log2 of the length, labelled with the lengths.
        let (x0, x1) = ((lo as f64).log2() - 0.3, (hi as f64).log2() + 0.3);
        let mut chart = ChartBuilder::on(area)
            .caption(panel.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, 0.0..ymax)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("sequence length")
            .y_desc(panel.y_label)
            .x_labels(((x1 - x0).ceil() as usize + 1).max(2))
            .x_label_formatter(&|x| {
                if (x - x.round()).abs() < 1e-6 {
                    format!("{}", 2f64.powf(x.round()) as u64)
                } else {
                    String::new()
                }
            })
            .light_line_style(WHITE.mix(0.0))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 15))
            .draw()
            .map_err(|e| err(&e))?;
        for (i, s) in panel.series.iter().enumerate() {
            let c = colour(&s.name, i);
            let xy: Vec<(f64, f64)> = s
                .points
                .iter()
                .map(|&(seq, v)| ((seq as f64).log2(), v))
                .collect();
            let label = match &s.failed {
                Some((seq, why)) => format!("{} ({why} at {seq})", s.name),
                None => s.name.clone(),
            };
            chart
                .draw_series(LineSeries::new(xy.clone(), c.stroke_width(3)))
                .map_err(|e| err(&e))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 22, y)], c.stroke_width(3))
                });
            chart
                .draw_series(xy.iter().map(|&p| Circle::new(p, 4, c.filled())))
                .map_err(|e| err(&e))?;
            // Where the line ends because the run failed: a cross on the
            // axis.
            if let Some((seq, _)) = &s.failed {
                let x = (*seq as f64).log2();
                chart
                    .draw_series(std::iter::once(Cross::new((x, 0.0), 7, c.stroke_width(3))))
                    .map_err(|e| err(&e))?;
            }
        }
        // The legend sits in the last panel (time), whose upper left
        // stays empty: times grow with the length.
        if k + 1 == fig.panels.len() {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK.mix(0.4))
                .label_font(("sans-serif", 14))
                .draw()
                .map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::train::TrainRow;

    /// A training row of model `m`, batch 1, bf16: measured (`ms`) or
    /// failed (`error`).
    pub(crate) fn row(imp: &str, seq: usize, ms: Option<f64>, error: Option<&str>) -> TrainRow {
        TrainRow {
            model: "m".into(),
            batch: 1,
            seq,
            dtype: "bf16".into(),
            implementation: imp.into(),
            ms_per_step: ms,
            ms_range: None,
            tokens_per_s: ms.map(|ms| seq as f64 / ms * 1e3),
            peak_mib: ms.map(|_| seq as f64),
            in_use_mib: None,
            first_step_s: None,
            start_s: None,
            cold_start_s: None,
            host_ms: None,
            error: error.map(String::from),
            devices: 1,
            memory: None,
        }
    }

    #[test]
    fn training_rows_become_one_line_per_implementation_ending_at_the_failure() {
        let mut report = Report::new("cuda", "gpu", false, f64::NAN);
        report.train = vec![
            row("burn", 2048, Some(200.0), None),
            row("bastile", 2048, Some(100.0), None),
            row("burn", 4096, None, Some("out of memory")),
            row("bastile", 4096, Some(250.0), None),
            row("bastile", 1024, Some(80.0), None),
        ];
        let figs = figures(&report);
        assert_eq!(figs.len(), 1);
        assert_eq!(figs[0].suffix, "train-m-b1");
        let latency = &figs[0].panels[2];
        assert_eq!(latency.series.len(), 2);
        let burn = &latency.series[0];
        assert_eq!(burn.points, vec![(2048, 200.0)]);
        assert_eq!(burn.failed, Some((4096, "out of memory".into())));
        let ours = &latency.series[1];
        assert_eq!(
            ours.points,
            vec![(1024, 80.0), (2048, 100.0), (4096, 250.0)]
        );
        assert_eq!(ours.failed, None);
        // Throughput in thousands of tokens per second.
        let tput = &figs[0].panels[0].series[1];
        assert!((tput.points[1].1 - 2048.0 / 100.0).abs() < 1e-9);
    }

    #[test]
    fn a_failed_attention_row_ends_its_line_and_survives_json() {
        let row = |imp: &str, seq, ms: f64, error: Option<&str>| crate::report::AttentionRow {
            shape: "s".into(),
            seq,
            dtype: "bf16".into(),
            implementation: imp.into(),
            fwd_ms: ms,
            fwd_tflops: ms,
            fwd_bwd_ms: ms,
            fwd_bwd_tflops: ms,
            peak_mib: ms,
            error: error.map(String::from),
        };
        let mut report = Report::new("cuda", "gpu", false, f64::NAN);
        report.attention = vec![
            row("burn", 2048, 4.0, None),
            row(
                "burn",
                4096,
                f64::NAN,
                Some("failed (panicked; the log says why)"),
            ),
            row("bastile", 4096, 2.0, None),
        ];
        // Written and read back as `--replot` does: NaN goes through null.
        let json = serde_json::to_value(&report).unwrap();
        let mut back = Report::new("", "", false, f64::NAN);
        crate::replot::merge_value(&mut back, json).unwrap();
        let figs = figures(&back);
        assert_eq!(figs.len(), 1);
        let latency = &figs[0].panels[2];
        assert_eq!(latency.series[0].points, vec![(2048, 4.0)]);
        assert_eq!(latency.series[0].failed, Some((4096, "failed".into())));
        assert_eq!(latency.series[1].points, vec![(4096, 2.0)]);
    }

    #[test]
    fn a_chart_is_drawn_when_a_font_is_present() {
        let mut report = Report::new("cuda", "gpu", false, f64::NAN);
        report.train = vec![
            row("burn", 1024, Some(90.0), None),
            row("bastile", 1024, Some(50.0), None),
            row("bastile", 2048, Some(70.0), None),
        ];
        if load_font().is_err() {
            eprintln!("no font on this machine: drawing not tested");
            return;
        }
        let dir = std::env::temp_dir().join(format!("bastile-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = draw_all(&report, &dir.join("r.json")).unwrap();
        assert_eq!(files, vec![dir.join("r-train-m-b1.png")]);
        let png = std::fs::read(&files[0]).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // A drawn chart holds the implementations' colours, not only white.
        let pixels = decode_rgb(&png);
        for c in [colour("burn", 0), colour("bastile", 1)] {
            assert!(pixels.contains(&[c.0, c.1, c.2]), "{c:?} drawn");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_rows_backend_keeps_its_implementations_colour() {
        assert_eq!(colour("bastile, CudaDirect", 7), colour("bastile", 0));
        assert_eq!(colour("bastile, Cuda", 7), colour("bastile", 0));
        assert_eq!(
            colour("bastile, LoRA r8, Cuda, 2 GPUs", 7),
            colour("bastile, LoRA r8, 2 GPUs", 7)
        );
    }

    /// The RGB pixels of a chart's PNG.
    fn decode_rgb(file: &[u8]) -> Vec<[u8; 3]> {
        let (info, mut reader) = png::Decoder::new(file).read_info().unwrap();
        assert_eq!((info.width, info.height), SIZE);
        assert_eq!(info.color_type, png::ColorType::RGB);
        let mut buf = vec![0; reader.output_buffer_size()];
        reader.next_frame(&mut buf).unwrap();
        buf.chunks(3).map(|c| [c[0], c[1], c[2]]).collect()
    }
}
