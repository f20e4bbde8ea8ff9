//! The deployment shorthand serving engineers use: `tp4`, `tp4pp2`, `tp2cp4`, `dep8`,
//! `dep8ep8`.
//!
//! A spec is a sequence of `<axis><size>` terms: `tp` (tensor parallel), `dep` (attention data
//! parallel over that many ranks, i.e. `tp` with attention DP), `pp`, `cp`, `ep` (MoE expert
//! parallel) and `moetp`. Each axis may appear once; `tp` and `dep` exclude each other. Unset
//! axes are 1, except MoE TP, which defaults to `tp / ep`.

use std::str::FromStr;

use kvferry_planner_abi::Mapping;

/// A parsed deployment spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spec(pub Mapping);

/// Why a deployment spec could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid deployment spec {spec:?}: {reason}")]
pub struct SpecError {
    spec: String,
    reason: String,
}

impl FromStr for Spec {
    type Err = SpecError;

    fn from_str(spec: &str) -> Result<Self, SpecError> {
        let fail = |reason: String| SpecError {
            spec: spec.to_string(),
            reason,
        };
        let lower = spec.trim().to_ascii_lowercase();
        if lower.is_empty() {
            return Err(fail("empty (try tp4, dep8, tp4pp2, tp2cp4)".into()));
        }
        let (mut tp, mut dep, mut pp, mut cp, mut ep, mut moe_tp) =
            (None, None, None, None, None, None);
        let mut rest = lower.as_str();
        while !rest.is_empty() {
            let name_len = rest
                .find(|c: char| c.is_ascii_digit())
                .ok_or_else(|| fail(format!("{rest:?} has no size")))?;
            let (name, after) = rest.split_at(name_len);
            let digits = after
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(after.len());
            let (number, tail) = after.split_at(digits);
            let size: u32 = number
                .parse()
                .map_err(|_| fail(format!("size {number:?} of {name} is not a number")))?;
            if size == 0 {
                return Err(fail(format!("{name} size is 0")));
            }
            let slot = match name {
                "tp" => &mut tp,
                "dep" => &mut dep,
                "pp" => &mut pp,
                "cp" => &mut cp,
                "ep" => &mut ep,
                "moetp" => &mut moe_tp,
                other => {
                    return Err(fail(format!(
                        "unknown axis {other:?} (known: tp, dep, pp, cp, ep, moetp)"
                    )));
                }
            };
            if slot.replace(size).is_some() {
                return Err(fail(format!("{name} given twice")));
            }
            rest = tail;
        }
        if tp.is_some() && dep.is_some() {
            return Err(fail(
                "tp and dep both given (dep N is tp N with attention DP)".into(),
            ));
        }
        let attention_dp = dep.is_some();
        let tp = dep.or(tp).unwrap_or(1);
        let moe_ep = ep.unwrap_or(1);
        let moe_tp = match moe_tp {
            Some(m) => m,
            None if tp % moe_ep == 0 => tp / moe_ep,
            None => {
                return Err(fail(format!("ep {moe_ep} does not divide tp {tp}")));
            }
        };
        if moe_tp * moe_ep != tp {
            return Err(fail(format!(
                "moetp {moe_tp} × ep {moe_ep} must equal the tp width {tp}"
            )));
        }
        Ok(Spec(Mapping {
            tp,
            pp: pp.unwrap_or(1),
            cp: cp.unwrap_or(1),
            moe_tp,
            moe_ep,
            attention_dp,
        }))
    }
}

/// Parses a spec into a [`Mapping`].
///
/// # Errors
///
/// A [`SpecError`] naming the term that is wrong.
pub fn parse(spec: &str) -> Result<Mapping, SpecError> {
    spec.parse::<Spec>().map(|s| s.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(tp: u32, pp: u32, cp: u32, moe_tp: u32, moe_ep: u32, adp: bool) -> Mapping {
        Mapping {
            tp,
            pp,
            cp,
            moe_tp,
            moe_ep,
            attention_dp: adp,
        }
    }

    #[test]
    fn parses_the_usual_shorthands() {
        assert_eq!(parse("tp4").unwrap(), m(4, 1, 1, 4, 1, false));
        assert_eq!(parse("tp4pp2").unwrap(), m(4, 2, 1, 4, 1, false));
        assert_eq!(parse("tp2cp4").unwrap(), m(2, 1, 4, 2, 1, false));
        assert_eq!(parse("dep8").unwrap(), m(8, 1, 1, 8, 1, true));
        assert_eq!(parse("dep8ep8").unwrap(), m(8, 1, 1, 1, 8, true));
        assert_eq!(parse("TP8EP4").unwrap(), m(8, 1, 1, 2, 4, false));
        assert_eq!(parse("pp2").unwrap(), m(1, 2, 1, 1, 1, false));
    }

    #[test]
    fn round_trips_through_display() {
        for s in ["tp4", "tp4pp2", "tp2cp4", "dep8", "dep8ep8"] {
            assert_eq!(parse(s).unwrap().to_string(), s);
        }
    }

    #[test]
    fn refuses_bad_specs_naming_the_problem() {
        let cases = [
            ("", "empty"),
            ("tp", "has no size"),
            ("xx4", "unknown axis \"xx\""),
            ("tp0", "tp size is 0"),
            ("tp2tp4", "tp given twice"),
            ("tp4dep4", "tp and dep both given"),
            ("tp4ep3", "ep 3 does not divide tp 4"),
            ("tp4moetp4ep2", "must equal the tp width 4"),
        ];
        for (spec, needle) in cases {
            let err = parse(spec).unwrap_err().to_string();
            assert!(err.contains(needle), "{spec}: {err}");
        }
    }
}
