//! A small Prometheus registry rendered in the text exposition format (`version=0.0.4`).
//!
//! Each [`Registry`] is owned by whoever records into it (the tiering manager owns one); there
//! is no global registry. Families are declared once with their label names (and buckets for
//! histograms); a series is resolved once to a [`SeriesId`] so that hot paths update it in O(1).
//! Counters are exposed as `<name>_total`, their `# HELP` and `# TYPE` lines included
//! (`# TYPE <name>_total counter`), exactly as the Python `prometheus_client` that vLLM exports
//! its metrics with writes them, so dashboards and queries written for vLLM keep working and
//! every parser sees each sample under its declared type. A counter declared as `x_total` is
//! the family `x` (`prometheus_client` strips the suffix the same way). Histograms are
//! `<name>_bucket` (cumulative, `le` last, `+Inf` included), `<name>_count`, `<name>_sum`.
//! `prometheus_client`'s `_created` gauges (a series' creation time) are not written, as vLLM
//! does not write them when it serves several API processes.

use std::fmt::Write as _;

use crate::error::{Error, ErrorKind, Result};

/// The `Content-Type` of [`Registry::render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The default namespace prefix.
pub const DEFAULT_PREFIX: &str = "kvtier:";

/// The kind of a metric family.
#[derive(Debug, Clone, PartialEq)]
pub enum MetricKind {
    /// Monotonic total.
    Counter,
    /// Current value.
    Gauge,
    /// Distribution over fixed upper bounds (ascending, `+Inf` implied).
    Histogram(Vec<f64>),
}

impl MetricKind {
    fn type_name(&self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram(_) => "histogram",
        }
    }
}

/// A declared family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FamilyId(usize);

/// One labelled series of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeriesId {
    family: usize,
    series: usize,
}

#[derive(Debug, Clone)]
struct Series {
    labels: Vec<String>,
    value: f64,
    bucket_counts: Vec<u64>,
    count: u64,
}

#[derive(Debug, Clone)]
struct Family {
    name: String,
    help: String,
    kind: MetricKind,
    label_names: Vec<String>,
    series: Vec<Series>,
}

/// A registry of metric families with a namespace prefix.
#[derive(Debug, Clone)]
pub struct Registry {
    prefix: String,
    families: Vec<Family>,
}

fn valid_name(s: &str, allow_colon: bool) -> bool {
    let mut chars = s.chars();
    let ok_first = |c: char| c.is_ascii_alphabetic() || c == '_' || (allow_colon && c == ':');
    matches!(chars.next(), Some(c) if ok_first(c))
        && chars.all(|c| ok_first(c) || c.is_ascii_digit())
}

impl Registry {
    /// An empty registry whose names get `prefix` (e.g. `kvtier:` or `vllm:`).
    pub fn new(prefix: impl Into<String>) -> Result<Self> {
        let prefix = prefix.into();
        if !prefix.is_empty() && !valid_name(&prefix, true) {
            return Err(Error::new(
                ErrorKind::Config,
                format!("metrics prefix {prefix:?} is not a valid Prometheus name prefix"),
            )
            .with("expected", "[a-zA-Z_:][a-zA-Z0-9_:]*"));
        }
        Ok(Registry {
            prefix,
            families: Vec::new(),
        })
    }

    /// The namespace prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Declares a family, or returns the existing one if it has the same kind and labels.
    /// `name` is without the prefix.
    pub fn family(
        &mut self,
        name: &str,
        help: &str,
        kind: MetricKind,
        label_names: &[&str],
    ) -> Result<FamilyId> {
        let name = match kind {
            MetricKind::Counter => name.strip_suffix("_total").unwrap_or(name),
            _ => name,
        };
        let full = format!("{}{name}", self.prefix);
        if let Some(i) = self.families.iter().position(|f| f.name == full) {
            let f = &self.families[i];
            if f.kind != kind || f.label_names != label_names {
                return Err(Error::new(
                    ErrorKind::Contract,
                    format!("metric {full} declared twice with different kind or labels"),
                ));
            }
            return Ok(FamilyId(i));
        }
        if !valid_name(&full, true) || label_names.iter().any(|l| !valid_name(l, false)) {
            return Err(Error::new(
                ErrorKind::Contract,
                format!("invalid metric or label name in {full} {label_names:?}"),
            ));
        }
        let exposed = exposed_names(&full, &kind);
        if let Some(other) = self.families.iter().find(|f| {
            exposed_names(&f.name, &f.kind)
                .iter()
                .any(|n| exposed.contains(n))
        }) {
            return Err(Error::new(
                ErrorKind::Contract,
                format!(
                    "metric {full} would expose a series named like one of {} ({:?})",
                    other.name, exposed
                ),
            ));
        }
        if let MetricKind::Histogram(b) = &kind
            && (b.is_empty() || b.windows(2).any(|w| w[0] >= w[1]) || b.iter().any(|x| x.is_nan()))
        {
            return Err(Error::new(
                ErrorKind::Contract,
                format!("histogram {full} needs strictly ascending buckets"),
            ));
        }
        self.families.push(Family {
            name: full,
            help: help.to_string(),
            kind,
            label_names: label_names.iter().map(|s| s.to_string()).collect(),
            series: Vec::new(),
        });
        Ok(FamilyId(self.families.len() - 1))
    }

    /// Resolves (creating if needed) the series with these label values.
    pub fn series(&mut self, family: FamilyId, label_values: &[&str]) -> Result<SeriesId> {
        let f = self.families.get_mut(family.0).ok_or_else(|| {
            Error::new(
                ErrorKind::Contract,
                format!("unknown metric family {}", family.0),
            )
        })?;
        if f.label_names.len() != label_values.len() {
            return Err(Error::new(
                ErrorKind::Contract,
                format!("metric {} takes {} labels", f.name, f.label_names.len()),
            )
            .with("found", label_values.len().to_string()));
        }
        if let Some(i) = f
            .series
            .iter()
            .position(|s| s.labels.iter().zip(label_values).all(|(a, b)| a == b))
        {
            return Ok(SeriesId {
                family: family.0,
                series: i,
            });
        }
        let buckets = match &f.kind {
            MetricKind::Histogram(b) => b.len(),
            _ => 0,
        };
        f.series.push(Series {
            labels: label_values.iter().map(|s| s.to_string()).collect(),
            value: 0.0,
            bucket_counts: vec![0; buckets],
            count: 0,
        });
        Ok(SeriesId {
            family: family.0,
            series: f.series.len() - 1,
        })
    }

    fn get(&mut self, id: SeriesId) -> Option<(&MetricKind, &mut Series)> {
        let f = self.families.get_mut(id.family)?;
        let s = f.series.get_mut(id.series)?;
        Some((&f.kind, s))
    }

    /// Adds `v` to a counter (negative or NaN increments are ignored) or a gauge.
    pub fn inc(&mut self, id: SeriesId, v: f64) {
        if let Some((kind, s)) = self.get(id) {
            match kind {
                MetricKind::Counter if v > 0.0 => s.value += v,
                MetricKind::Gauge if v.is_finite() => s.value += v,
                _ => {}
            }
        }
    }

    /// Sets a gauge, or a counter mirrored from a monotonic total kept elsewhere.
    pub fn set(&mut self, id: SeriesId, v: f64) {
        if let Some((kind, s)) = self.get(id)
            && !matches!(kind, MetricKind::Histogram(_))
        {
            s.value = v;
        }
    }

    /// Records one observation in a histogram.
    pub fn observe(&mut self, id: SeriesId, v: f64) {
        if let Some((MetricKind::Histogram(bounds), s)) = self.get(id) {
            if v.is_nan() {
                return;
            }
            if let Some(i) = bounds.iter().position(|b| v <= *b) {
                s.bucket_counts[i] += 1;
            }
            s.count += 1;
            s.value += v;
        }
    }

    fn find(&self, name: &str, labels: &[&str]) -> Option<(&Family, &Series)> {
        let full = format!("{}{name}", self.prefix);
        let f = self.families.iter().find(|f| f.name == full)?;
        let s = f.series.iter().find(|s| {
            s.labels.len() == labels.len() && s.labels.iter().zip(labels).all(|(a, b)| a == b)
        })?;
        Some((f, s))
    }

    /// The value of a counter or gauge series, or a histogram's sum (`name` without prefix).
    pub fn value(&self, name: &str, labels: &[&str]) -> Option<f64> {
        self.find(name, labels).map(|(_, s)| s.value)
    }

    /// A histogram series' observation count.
    pub fn histogram_count(&self, name: &str, labels: &[&str]) -> Option<u64> {
        self.find(name, labels).map(|(_, s)| s.count)
    }

    /// Names (with prefix) of every declared family.
    pub fn family_names(&self) -> Vec<&str> {
        self.families.iter().map(|f| f.name.as_str()).collect()
    }

    /// Renders every family in the text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(256 * self.families.len());
        for f in &self.families {
            // A counter's metadata carries its sample name, `_total` included.
            let exposed = match f.kind {
                MetricKind::Counter => format!("{}_total", f.name),
                _ => f.name.clone(),
            };
            let _ = writeln!(out, "# HELP {exposed} {}", escape_help(&f.help));
            let _ = writeln!(out, "# TYPE {exposed} {}", f.kind.type_name());
            let plain = label_order(&f.label_names, false);
            let with_le = label_order(&f.label_names, true);
            for s in &f.series {
                let labels = (&f.label_names[..], &s.labels[..]);
                match &f.kind {
                    MetricKind::Counter | MetricKind::Gauge => {
                        sample(&mut out, &exposed, &plain, labels, None, s.value);
                    }
                    MetricKind::Histogram(bounds) => {
                        let bucket = format!("{}_bucket", f.name);
                        let mut cumulative = 0u64;
                        let counts = s.bucket_counts.iter().map(|c| {
                            cumulative += c;
                            cumulative
                        });
                        for (b, c) in bounds.iter().zip(counts) {
                            let le = fmt_value(*b);
                            let le = Some(le.as_str());
                            sample(&mut out, &bucket, &with_le, labels, le, c as f64);
                        }
                        let inf = Some("+Inf");
                        sample(&mut out, &bucket, &with_le, labels, inf, s.count as f64);
                        let count = format!("{}_count", f.name);
                        sample(&mut out, &count, &plain, labels, None, s.count as f64);
                        let sum = format!("{}_sum", f.name);
                        sample(&mut out, &sum, &plain, labels, None, s.value);
                    }
                }
            }
        }
        out
    }
}

/// The sample names a family exposes (two families may not share one).
fn exposed_names(name: &str, kind: &MetricKind) -> Vec<String> {
    match kind {
        MetricKind::Counter => vec![format!("{name}_total")],
        MetricKind::Gauge => vec![name.to_string()],
        MetricKind::Histogram(_) => ["_bucket", "_count", "_sum"]
            .iter()
            .map(|suffix| format!("{name}{suffix}"))
            .collect(),
    }
}

/// The order a family's labels are written in: sorted by name, as `prometheus_client` writes
/// them; `None` stands for a histogram bucket's `le`.
fn label_order(names: &[String], with_le: bool) -> Vec<Option<usize>> {
    let mut order: Vec<Option<usize>> = (0..names.len()).map(Some).collect();
    if with_le {
        order.push(None);
    }
    order.sort_by_key(|i| i.map_or("le", |i| names[i].as_str()));
    order
}

fn sample(
    out: &mut String,
    name: &str,
    order: &[Option<usize>],
    (names, values): (&[String], &[String]),
    le: Option<&str>,
    v: f64,
) {
    out.push_str(name);
    let mut first = true;
    for i in order {
        let (n, val) = match (*i, le) {
            (Some(i), _) => (names[i].as_str(), escape_label(&values[i])),
            (None, Some(le)) => ("le", le.to_string()),
            (None, None) => continue,
        };
        out.push(if first { '{' } else { ',' });
        first = false;
        let _ = write!(out, "{n}=\"{val}\"");
    }
    if !first {
        out.push('}');
    }
    let _ = writeln!(out, " {}", fmt_value(v));
}

/// Formats a value the way Python's `prometheus_client` does (`floatToGoString`): `+Inf`,
/// `-Inf`, `NaN`, Python's shortest `repr` (`1e-05`, `0.005`, `60.0`), and Go-style exponents
/// for positive values with more than six integer digits (`4.096e+06`), so label values such
/// as `le` match vLLM's exposition byte for byte.
pub fn fmt_value(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v == f64::INFINITY {
        return "+Inf".into();
    }
    if v == f64::NEG_INFINITY {
        return "-Inf".into();
    }
    let s = python_repr(v);
    if v > 0.0
        && let Some(dot) = s.find('.')
        && dot > 6
    {
        let digits = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
        let mantissa = digits.trim_end_matches(['0', '.']);
        return format!("{mantissa}e+0{}", dot - 1);
    }
    s
}

/// Python's `repr(float)`: shortest round-trip digits, scientific below 1e-4 or from 1e16.
fn python_repr(v: f64) -> String {
    if v == 0.0 {
        return if v.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let sci = format!("{v:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if !(-4..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let s = format!("{v}");
    if s.contains('.') { s } else { format!("{s}.0") }
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_histograms() {
        let mut r = Registry::new("kvtier:").unwrap();
        let c = r
            .family("read_bytes", "Bytes read.", MetricKind::Counter, &["tier"])
            .unwrap();
        let g = r
            .family("usage", "Use \\ \"x\"\nok", MetricKind::Gauge, &[])
            .unwrap();
        let h = r
            .family(
                "lat",
                "Latency.",
                MetricKind::Histogram(vec![0.1, 1.0]),
                &["tier", "result"],
            )
            .unwrap();
        let s1 = r.series(c, &["1:memory"]).unwrap();
        assert_eq!(
            r.series(c, &["1:memory"]).unwrap(),
            s1,
            "series resolved once"
        );
        r.inc(s1, 4096.0);
        r.inc(s1, -5.0);
        let sg = r.series(g, &[]).unwrap();
        r.set(sg, 0.25);
        let sh = r.series(h, &["1:a\"b", "success"]).unwrap();
        for v in [0.05, 0.5, 5.0] {
            r.observe(sh, v);
        }
        let text = r.render();
        let want = "\
# HELP kvtier:read_bytes_total Bytes read.
# TYPE kvtier:read_bytes_total counter
kvtier:read_bytes_total{tier=\"1:memory\"} 4096.0
# HELP kvtier:usage Use \\\\ \"x\"\\nok
# TYPE kvtier:usage gauge
kvtier:usage 0.25
# HELP kvtier:lat Latency.
# TYPE kvtier:lat histogram
kvtier:lat_bucket{le=\"0.1\",result=\"success\",tier=\"1:a\\\"b\"} 1.0
kvtier:lat_bucket{le=\"1.0\",result=\"success\",tier=\"1:a\\\"b\"} 2.0
kvtier:lat_bucket{le=\"+Inf\",result=\"success\",tier=\"1:a\\\"b\"} 3.0
kvtier:lat_count{result=\"success\",tier=\"1:a\\\"b\"} 3.0
kvtier:lat_sum{result=\"success\",tier=\"1:a\\\"b\"} 5.55
";
        assert_eq!(text, want);
        assert_eq!(r.value("read_bytes", &["1:memory"]), Some(4096.0));
        assert_eq!(r.histogram_count("lat", &["1:a\"b", "success"]), Some(3));
    }

    #[test]
    fn values_format_like_prometheus_client() {
        let cases = [
            (1e-5, "1e-05"),
            (5e-5, "5e-05"),
            (1e-4, "0.0001"),
            (0.005, "0.005"),
            (1.0, "1.0"),
            (60.0, "60.0"),
            (4096.0, "4096.0"),
            (123456.0, "123456.0"),
            (4096000.0, "4.096e+06"),
            (1e16, "1e+16"),
            (-2.5, "-2.5"),
            (0.0, "0.0"),
            (f64::INFINITY, "+Inf"),
        ];
        for (v, want) in cases {
            assert_eq!(fmt_value(v), want, "{v}");
        }
    }

    #[test]
    fn rejects_bad_declarations() {
        assert!(Registry::new("bad prefix").is_err());
        let mut r = Registry::new("vllm:").unwrap();
        let f = r.family("x", "", MetricKind::Counter, &["tier"]).unwrap();
        assert_eq!(
            r.family("x", "", MetricKind::Counter, &["tier"]).unwrap(),
            f
        );
        assert!(r.family("x", "", MetricKind::Gauge, &["tier"]).is_err());
        assert!(
            r.family("h", "", MetricKind::Histogram(vec![1.0, 1.0]), &[])
                .is_err()
        );
        assert!(r.family("bad-name", "", MetricKind::Gauge, &[]).is_err());
        // `x_total` is the counter `x`; a gauge or histogram may not expose `x_total` again.
        assert_eq!(
            r.family("x_total", "", MetricKind::Counter, &["tier"])
                .unwrap(),
            f
        );
        assert!(r.family("x_total", "", MetricKind::Gauge, &[]).is_err());
        let h = MetricKind::Histogram(vec![1.0]);
        r.family("lat", "", h.clone(), &[]).unwrap();
        assert!(r.family("lat_count", "", MetricKind::Gauge, &[]).is_err());
        assert!(r.family("lat_sum", "", MetricKind::Counter, &[]).is_ok());
        assert!(r.series(f, &[]).is_err(), "label count mismatch");
        assert_eq!(r.family_names(), vec!["vllm:x", "vllm:lat", "vllm:lat_sum"]);
    }
}
