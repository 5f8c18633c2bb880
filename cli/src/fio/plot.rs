//! A self-contained SVG chart for `kvtier fio-compare --plot`: a grid of panels (one per row
//! size and profile), throughput (GB/s) against queue depth for kvtier, fio on the same kind of
//! memory and fio's best configuration. Plain SVG text, no dependencies, readable in any
//! browser.

use std::fmt::Write;

/// One line of a panel.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub label: String,
    /// Throughput in bytes per second, one per depth (NaN: not measured).
    pub values: Vec<f64>,
}

impl Series {
    /// A series labelled `label`.
    pub fn new(label: &str, values: Vec<f64>) -> Self {
        Series {
            label: label.to_string(),
            values,
        }
    }
}

/// One panel: its series over the same depths.
#[derive(Debug, Clone)]
pub struct Panel {
    /// Panel title (row size and profile).
    pub title: String,
    /// X values: queue depths (I/Os in flight), ascending.
    pub depths: Vec<u32>,
    /// The lines: kvtier first, then fio's.
    pub series: Vec<Series>,
}

const PANEL_W: f64 = 420.0;
const PANEL_H: f64 = 320.0;
const MARGIN_L: f64 = 60.0;
const MARGIN_R: f64 = 20.0;
const MARGIN_T: f64 = 50.0;
const MARGIN_B: f64 = 50.0;
/// Series colours in order: kvtier, fio on the same memory, fio's best, fio verifying what it
/// loads.
const COLORS: [&str; 4] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

/// Renders the panels as one SVG document, `columns` panels per row. `subtitle` describes the
/// setup (region, fio's memory, path).
pub fn render_svg(panels: &[Panel], columns: usize, subtitle: &str) -> String {
    let columns = columns.clamp(1, panels.len().max(1));
    let rows = panels.len().div_ceil(columns).max(1);
    let width = PANEL_W * columns as f64;
    let height = PANEL_H * rows as f64 + 40.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{width}" height="{height}" fill="white"/>"#
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="20" text-anchor="middle" font-size="14">kvtier vs fio: throughput against queue depth</text>"#,
        width / 2.0
    );
    let _ = writeln!(
        svg,
        r##"<text x="{:.1}" y="36" text-anchor="middle" fill="#555">{}</text>"##,
        width / 2.0,
        escape(subtitle)
    );
    for (i, panel) in panels.iter().enumerate() {
        let (row, col) = (i / columns, i % columns);
        draw_panel(
            &mut svg,
            panel,
            PANEL_W * col as f64,
            40.0 + PANEL_H * row as f64,
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn draw_panel(svg: &mut String, panel: &Panel, x0: f64, y0: f64) {
    let plot_w = PANEL_W - MARGIN_L - MARGIN_R;
    let plot_h = PANEL_H - MARGIN_T - MARGIN_B;
    let left = x0 + MARGIN_L;
    let top = y0 + MARGIN_T;
    let bottom = top + plot_h;
    let gb = |v: f64| v / 1e9;
    let max_y = panel
        .series
        .iter()
        .flat_map(|s| s.values.iter())
        .copied()
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let y_top = nice_ceiling(gb(max_y));
    let n = panel.depths.len();
    // Depths are powers of two in practice: spread them evenly (log scale).
    let x_of = |i: usize| {
        if n <= 1 {
            left + plot_w / 2.0
        } else {
            left + plot_w * i as f64 / (n - 1) as f64
        }
    };
    let y_of = |bytes_per_sec: f64| bottom - plot_h * (gb(bytes_per_sec) / y_top).clamp(0.0, 1.0);

    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="13" font-weight="bold">{}</text>"#,
        left + plot_w / 2.0,
        y0 + 22.0,
        escape(&panel.title)
    );
    // Axes and horizontal grid.
    for k in 0..=4 {
        let v = y_top * k as f64 / 4.0;
        let y = bottom - plot_h * k as f64 / 4.0;
        let _ = writeln!(
            svg,
            r##"<line x1="{left:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            left + plot_w,
            left - 6.0,
            y + 4.0,
            trim_number(v)
        );
    }
    let _ = writeln!(
        svg,
        r#"<line x1="{left:.1}" y1="{top:.1}" x2="{left:.1}" y2="{bottom:.1}" stroke="black"/><line x1="{left:.1}" y1="{bottom:.1}" x2="{:.1}" y2="{bottom:.1}" stroke="black"/>"#,
        left + plot_w
    );
    for (i, d) in panel.depths.iter().enumerate() {
        let x = x_of(i);
        let _ = writeln!(
            svg,
            r#"<line x1="{x:.1}" y1="{bottom:.1}" x2="{x:.1}" y2="{:.1}" stroke="black"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{d}</text>"#,
            bottom + 4.0,
            bottom + 18.0
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">queue depth (rows in flight)</text>"#,
        left + plot_w / 2.0,
        bottom + 36.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" transform="rotate(-90 {:.1} {:.1})">GB/s</text>"#,
        x0 + 16.0,
        top + plot_h / 2.0,
        x0 + 16.0,
        top + plot_h / 2.0
    );
    // Series.
    for (k, series) in panel.series.iter().enumerate() {
        let (values, label) = (&series.values, escape(&series.label));
        let color = COLORS[k % COLORS.len()];
        let legend_row = k as f64;
        let points: Vec<String> = values
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, v)| format!("{:.1},{:.1}", x_of(i), y_of(*v)))
            .collect();
        if points.len() > 1 {
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
                points.join(" ")
            );
        }
        for p in &points {
            let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(svg, r#"<circle cx="{x}" cy="{y}" r="3" fill="{color}"/>"#);
        }
        let ly = top + 8.0 + 16.0 * legend_row;
        let _ = writeln!(
            svg,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{label}</text>"#,
            left + 10.0,
            left + 30.0,
            left + 36.0,
            ly + 4.0
        );
    }
}

/// The smallest of 1, 2, 5 x 10^k that is >= `v` (at least 0.1).
fn nice_ceiling(v: f64) -> f64 {
    let v = if v.is_finite() && v > 0.1 { v } else { 0.1 };
    let exp = v.log10().floor();
    let base = 10f64.powf(exp);
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * base >= v - 1e-12 {
            return m * base;
        }
    }
    10.0 * base
}

fn trim_number(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_has_every_series_per_panel() {
        let two = |k: Vec<f64>, f: Vec<f64>| vec![Series::new("kvtier", k), Series::new("fio", f)];
        let panels = vec![
            Panel {
                title: "store".into(),
                depths: vec![1, 2, 4],
                series: two(vec![1e9, 1.8e9, 2.1e9], vec![1.1e9, 1.9e9, 2.2e9]),
            },
            Panel {
                title: "load <rand>".into(),
                depths: vec![1, 2, 4],
                series: two(vec![0.5e9, 1e9, f64::NAN], vec![0.6e9, 1.2e9, 1.5e9]),
            },
        ];
        let svg = render_svg(&panels, 2, "2 MiB rows on /tmp & more");
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 4);
        // 3 + 3 points in the first panel, 2 + 3 in the second (NaN skipped).
        assert_eq!(svg.matches("<circle").count(), 11);
        assert!(svg.contains("load &lt;rand&gt;"));
        assert!(svg.contains("/tmp &amp; more"));
        assert!(!svg.contains("NaN"));
        // A grid: 3 panels of 3 series, 2 per row, make 2 rows.
        let mut three = panels[0].clone();
        three
            .series
            .push(Series::new("fio best", vec![1.2e9, 2.0e9, 2.3e9]));
        let svg = render_svg(&[three.clone(), three.clone(), three], 2, "grid");
        assert_eq!(svg.matches("<polyline").count(), 9);
        assert!(svg.contains(&format!("height=\"{}\"", PANEL_H * 2.0 + 40.0)));
        assert!(svg.contains("fio best"));
    }

    #[test]
    fn nice_ceilings() {
        assert_eq!(nice_ceiling(2.2), 2.5);
        assert_eq!(nice_ceiling(0.0), 0.1);
        assert_eq!(nice_ceiling(7.0), 10.0);
        assert_eq!(nice_ceiling(10.0), 10.0);
        assert_eq!(trim_number(2.50), "2.5");
        assert_eq!(trim_number(10.0), "10");
    }
}
