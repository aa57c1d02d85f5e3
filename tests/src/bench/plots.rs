//! The mode comparison's plots, SVG and PNG (plotters): new connections per second,
//! connect p99 and control-plane times against the number of services, one line per mode,
//! log axes (the counts and the modes' costs both span orders of magnitude).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use plotters::prelude::*;

use super::{
    load::median_min_max,
    report::{label, ControlSample, Run, Workload, BASELINE},
};

/// Where the plots' text gets its glyphs and metrics (Debian's fonts-dejavu-core).
pub const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// One plotted line: a label and its (services, value) points.
type Series = (String, Vec<(f64, f64)>);

/// Registers [`FONT`] as plotters' "sans-serif" (once).
pub fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let bytes = std::fs::read(FONT)
                .map_err(|e| format!("{FONT}: {e} (install fonts-dejavu-core for PNG plots)"))?;
            plotters::style::register_font(
                "sans-serif",
                FontStyle::Normal,
                Box::leak(bytes.into_boxed_slice()),
            )
            .map_err(|_| format!("{FONT} is not a font plotters can read"))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// The whole decades around `lo..hi`: a log axis labels its powers of ten, so each axis
/// spans at least two of them.
fn decades(lo: f64, hi: f64) -> std::ops::Range<f64> {
    let lo = 10f64.powf(lo.log10().floor());
    let hi = 10f64.powf(hi.log10().ceil()).max(lo * 10.0);
    lo..hi
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    y_desc: &str,
    series: &[Series],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing {title}: {e:?}");
    let points = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in points {
        x0 = x0.min(*x);
        x1 = x1.max(*x);
        y0 = y0.min(*y);
        y1 = y1.max(*y);
    }
    if x0 > x1 {
        bail!("{title}: nothing to plot");
    }
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(decades(x0, x1).log_scale(), decades(y0, y1).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("services programmed")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| {
            if *y >= 1.0 {
                format!("{y:.0}")
            } else {
                format!("{y}")
            }
        })
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    for (i, (label, line)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(line.iter().copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(line.iter().map(|p| Circle::new(*p, 3, color.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerLeft)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Writes `stem.svg` and `stem.png`; returns both paths.
fn plot(
    dir: &Path,
    stem: &str,
    title: &str,
    y_desc: &str,
    series: &[Series],
) -> Result<Vec<PathBuf>> {
    let svg = dir.join(format!("{stem}.svg"));
    let png = dir.join(format!("{stem}.png"));
    // Text is laid out with the font's metrics, in SVG too.
    register_font()?;
    draw(
        SVGBackend::new(&svg, (900, 560)).into_drawing_area(),
        title,
        y_desc,
        series,
    )
    .with_context(|| format!("writing {}", svg.display()))?;
    draw(
        BitMapBackend::new(&png, (900, 560)).into_drawing_area(),
        title,
        y_desc,
        series,
    )
    .with_context(|| format!("writing {}", png.display()))?;
    Ok(vec![svg, png])
}

/// Median of a workload per service count, one series per target.
fn data_plane(run: &Run, workload: Workload) -> Vec<Series> {
    run.targets()
        .into_iter()
        .map(|target| {
            let points = run
                .service_counts()
                .into_iter()
                .filter_map(|n| {
                    let v = run.values(n, &target, workload);
                    (!v.is_empty()).then(|| (n as f64, median_min_max(&v).0))
                })
                .filter(|(_, y)| *y > 0.0)
                .collect();
            (label(&target).to_string(), points)
        })
        .filter(|(_, p): &Series| !p.is_empty())
        .collect()
}

/// One figure of the control-plane records.
type Figure = fn(&ControlSample) -> Option<f64>;

fn control_plane(run: &Run) -> Vec<Series> {
    let cold: Figure = |c| c.cold_start_ms;
    let figures: [(&[ControlSample], &str, Figure); 4] = [
        (&run.control, "cold start", cold),
        (&run.control, "one change, its sync", |c| {
            c.one_change_sync_ms
        }),
        (&run.api, "cold start, API source", cold),
        (&run.api, "one change end to end, API source", |c| {
            c.one_change_ms
        }),
    ];
    let mut out = Vec::new();
    for mode in run.targets().into_iter().filter(|t| t != BASELINE) {
        for (records, what, get) in figures {
            let points: Vec<(f64, f64)> = records
                .iter()
                .filter(|c| c.mode == mode)
                .filter_map(|c| Some((c.services as f64, get(c)?)))
                .filter(|(_, y)| *y > 0.0)
                .collect();
            if !points.is_empty() {
                out.push((format!("{mode}: {what}"), points));
            }
        }
    }
    out
}

/// The plots of a run, into `dir`; returns the files written.
pub fn write_all(run: &Run, dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    files.extend(plot(
        dir,
        "connections",
        "New connections per second through one ClusterIP",
        "connections/s (median of rounds)",
        &data_plane(run, Workload::ConnectionsPerSecond),
    )?);
    files.extend(plot(
        dir,
        "connect-p99",
        "Connect time, 99th percentile",
        "µs (median of rounds)",
        &data_plane(run, Workload::ConnectP99Us),
    )?);
    let cpu = data_plane(run, Workload::CpuUsPerConnection);
    if !cpu.is_empty() {
        files.extend(plot(
            dir,
            "cpu-per-connection",
            "CPU time per new connection, every core busy (client, backends, datapath)",
            "µs of CPU per connection (median of rounds)",
            &cpu,
        )?);
    }
    let control = control_plane(run);
    if !control.is_empty() {
        files.extend(plot(
            dir,
            "sync",
            "Agent start until served; the agent's sync of one more endpoint",
            "ms",
            &control,
        )?);
    }
    Ok(files)
}
