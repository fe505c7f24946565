//! Which DRAM objects the pool demotes to this tier, and how an operator spells the policy.

use super::error::InvalidSetting;

/// Which DRAM objects the evictor demotes to SSD instead of dropping (docs/ssd.md,
/// "Admission"). Every write wears the drive; the default keeps objects that proved useful
/// (loaded at least once) or that are young (evicted soon after being stored: DRAM churns
/// faster than the prefix is reused), and drops old never-loaded ones.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SsdAdmission {
    /// Every evicted object.
    All,
    /// Objects loaded at least once while in DRAM.
    Hit,
    /// Objects loaded at least once, or stored less than `young` before their eviction.
    HitOrYoung { young: std::time::Duration },
    /// None: the tier only serves what it already holds (e.g. a read-only warm start).
    Never,
}

/// Default age under which an evicted object counts as young (`hit-or-young`).
pub const DEFAULT_YOUNG: std::time::Duration = std::time::Duration::from_secs(60);

impl Default for SsdAdmission {
    fn default() -> Self {
        SsdAdmission::HitOrYoung { young: DEFAULT_YOUNG }
    }
}

impl SsdAdmission {
    /// `all`, `hit`, `never`, `hit-or-young` (60 s) or `hit-or-young:SECONDS`.
    pub fn parse(key: &str, value: &str) -> Result<Self, InvalidSetting> {
        let bad = || InvalidSetting {
            key: key.into(),
            message: format!("{value:?}: expected all, hit, never, hit-or-young or hit-or-young:SECONDS"),
        };
        let v = value.trim().to_ascii_lowercase();
        Ok(match v.as_str() {
            "all" => SsdAdmission::All,
            "hit" => SsdAdmission::Hit,
            "never" | "none" => SsdAdmission::Never,
            "hit-or-young" => SsdAdmission::default(),
            _ => {
                let secs = v.strip_prefix("hit-or-young:").ok_or_else(bad)?;
                let secs: f64 = secs.trim().parse().map_err(|_| bad())?;
                if !(secs.is_finite() && secs >= 0.0) {
                    return Err(bad());
                }
                SsdAdmission::HitOrYoung { young: std::time::Duration::from_secs_f64(secs) }
            }
        })
    }

    /// Whether an object evicted `age` after it was stored, loaded `hits` times, goes to SSD.
    pub fn admits(&self, age: std::time::Duration, hits: u32) -> bool {
        match *self {
            SsdAdmission::All => true,
            SsdAdmission::Hit => hits > 0,
            SsdAdmission::HitOrYoung { young } => hits > 0 || age < young,
            SsdAdmission::Never => false,
        }
    }
}

impl std::fmt::Display for SsdAdmission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SsdAdmission::All => f.write_str("all"),
            SsdAdmission::Hit => f.write_str("hit"),
            SsdAdmission::Never => f.write_str("never"),
            SsdAdmission::HitOrYoung { young } => write!(f, "hit-or-young:{}", young.as_secs_f64()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SsdAdmission;
    use std::time::Duration;

    #[test]
    fn admission_policies_parse_and_decide() {
        let p = |v| SsdAdmission::parse("ssd-admission", v);
        assert_eq!(p("all"), Ok(SsdAdmission::All));
        assert_eq!(p(" Hit "), Ok(SsdAdmission::Hit));
        assert_eq!(p("never"), Ok(SsdAdmission::Never));
        assert_eq!(p("hit-or-young"), Ok(SsdAdmission::default()));
        let y = p("hit-or-young:2.5").unwrap();
        assert_eq!(y, SsdAdmission::HitOrYoung { young: Duration::from_millis(2500) });
        assert_eq!(y.to_string(), "hit-or-young:2.5");
        for bad in ["sometimes", "hit-or-young:", "hit-or-young:-1", "hit-or-young:x"] {
            assert!(p(bad).unwrap_err().to_string().starts_with("ssd-admission"), "{bad}");
        }
        let s = Duration::from_secs;
        assert!(SsdAdmission::All.admits(s(1000), 0));
        assert!(!SsdAdmission::Never.admits(s(0), 5));
        assert!(SsdAdmission::Hit.admits(s(1000), 1) && !SsdAdmission::Hit.admits(s(0), 0));
        assert!(y.admits(s(1), 0) && !y.admits(s(3), 0) && y.admits(s(3), 1), "young or hit");
    }
}
