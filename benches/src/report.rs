//! One output convention for every `umbp-bench` subcommand (docs/benchmarks.md): one JSON object
//! per measured case and line with `--json`, a readable table otherwise.

use serde::Serialize;
use serde_json::{Map, Value};

/// Is a bigger or a smaller value better? Decides how `speedup` is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Better {
    /// Times: speedup = baseline / value.
    Lower,
    /// Rates: speedup = value / baseline.
    Higher,
}

/// One measured case.
#[derive(Debug, Clone, Serialize)]
pub struct Case {
    pub bench: String,
    pub case: String,
    pub value: f64,
    pub unit: String,
    pub baseline: f64,
    pub baseline_name: String,
    pub speedup: f64,
    /// Free-form context (cpus, iterations, sizes...), printed after the fixed fields.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Case {
    pub fn new(bench: &str, case: &str, value: f64, unit: &str, baseline: f64, baseline_name: &str, better: Better) -> Self {
        let speedup = match better {
            Better::Lower if value > 0.0 => baseline / value,
            Better::Higher if baseline > 0.0 => value / baseline,
            _ => f64::NAN,
        };
        Self {
            bench: bench.into(),
            case: case.into(),
            value: round(value),
            unit: unit.into(),
            baseline: round(baseline),
            baseline_name: baseline_name.into(),
            speedup: (speedup * 100.0).round() / 100.0,
            extra: Map::new(),
        }
    }

    pub fn extra(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(key.into(), value.into());
        self
    }

    pub fn extras(mut self, extra: &Map<String, Value>) -> Self {
        for (k, v) in extra {
            self.extra.insert(k.clone(), v.clone());
        }
        self
    }
}

/// Rounds to 3 significant decimals for values < 100 and to integers above.
pub fn round(v: f64) -> f64 {
    if v.abs() >= 100.0 {
        v.round()
    } else {
        (v * 1000.0).round() / 1000.0
    }
}

pub fn print(cases: &[Case], json: bool) {
    if json {
        for c in cases {
            println!("{}", serde_json::to_string(c).expect("serialise case"));
        }
        return;
    }
    let rows: Vec<[String; 6]> = cases
        .iter()
        .map(|c| {
            [
                format!("{}/{}", c.bench, c.case),
                format!("{} {}", c.value, c.unit),
                format!("{} {}", c.baseline, c.unit),
                format!("{:.2}x", c.speedup),
                c.baseline_name.clone(),
                c.extra.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "),
            ]
        })
        .collect();
    let head = ["case", "value", "baseline", "speedup", "baseline is", "context"];
    let mut width = head.map(str::len);
    for r in &rows {
        for (w, cell) in width.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; 6]| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(width).enumerate() {
            if i == 5 {
                s.push_str(cell);
            } else if i == 1 || i == 2 || i == 3 {
                s.push_str(&format!("{cell:>w$}  "));
            } else {
                s.push_str(&format!("{cell:<w$}  "));
            }
        }
        s.trim_end().to_string()
    };
    println!("{}", line(head));
    println!("{}", line(width.map(|w| "-".repeat(w)).each_ref().map(|s| s.as_str())));
    for r in &rows {
        println!("{}", line(r.each_ref().map(|s| s.as_str())));
    }
}

/// Percentile (nearest rank) of sorted samples.
pub fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64
}

/// Logical CPUs available to this process.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speedup_direction_and_json_shape() {
        let c = Case::new("ring", "poll_rtt_p50", 850.0, "ns", 12000.0, "unix socket round trip", Better::Lower).extra("cpus", 2);
        assert_eq!(c.speedup, 14.12);
        let j = serde_json::to_string(&c).unwrap();
        assert!(j.starts_with(r#"{"bench":"ring","case":"poll_rtt_p50","value":850.0,"unit":"ns","baseline":12000.0"#), "{j}");
        assert!(j.ends_with(r#""speedup":14.12,"cpus":2}"#), "{j}");
        let r = Case::new("x", "rate", 30.0, "M/s", 10.0, "b", Better::Higher);
        assert_eq!(r.speedup, 3.0);
        assert_eq!(percentile(&[1, 2, 3, 4], 50.0), 2.0);
        assert_eq!(percentile(&[1, 2, 3, 4], 99.0), 4.0);
    }
}
