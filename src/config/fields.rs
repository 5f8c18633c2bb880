//! Typed reads from a parsed configuration value, with errors that name the key path, the
//! value found and what is allowed.

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The key path of `key` inside `parent` (`""` is the root).
pub(crate) fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_string()
    } else {
        format!("{parent}.{key}")
    }
}

/// The key path of element `i` of the list at `parent`.
pub(crate) fn index(parent: &str, i: usize) -> String {
    format!("{parent}[{i}]")
}

/// A short description of a value for error messages: `string "abc"`, `number 1.5`, `array`.
pub(crate) fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) if s.chars().count() > 60 => {
            let head: String = s.chars().take(57).collect();
            format!("string {:?}", format!("{head}..."))
        }
        Value::String(s) => format!("string {s:?}"),
        Value::Array(a) => format!("array of {} element(s)", a.len()),
        Value::Object(_) => "object".to_string(),
    }
}

/// A wrong-type error: `path: wrong type (expected: ..., found: ...)`.
pub(crate) fn type_error(path: &str, expected: &str, found: &Value) -> Error {
    Error::config(path, "wrong type")
        .with("expected", expected)
        .with("found", describe(found))
}

/// An out-of-range error: `path: value out of range (allowed: ..., found: ...)`.
pub(crate) fn range_error(path: &str, allowed: &str, found: impl ToString) -> Error {
    Error::config(path, "value out of range")
        .with("allowed", allowed)
        .with("found", found.to_string())
}

/// A missing required key.
pub(crate) fn missing(path: &str, expected: &str) -> Error {
    Error::config(path, "required key is missing").with("expected", expected)
}

/// The closest candidate to `key`, if any is close enough to be a plausible misspelling:
/// few edits for its length, or a strong common prefix (Jaro-Winkler). Fewest edits win.
pub(crate) fn closest<'a>(key: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let lower = key.to_ascii_lowercase();
    candidates
        .iter()
        .map(|c| {
            let edits = strsim::damerau_levenshtein(&lower, &c.to_ascii_lowercase());
            (edits, strsim::jaro_winkler(&lower, c), *c)
        })
        .filter(|(edits, jw, c)| *edits <= (c.len() / 3).max(1) || *jw >= 0.85)
        .min_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)))
        .map(|(_, _, c)| c)
}

/// Whether `key` looks like a misspelling of `candidate` (not equal, within a small edit
/// distance scaled to the length, or equal up to case).
pub(crate) fn is_near_miss(key: &str, candidate: &str) -> bool {
    if key == candidate {
        return false;
    }
    if key.eq_ignore_ascii_case(candidate) {
        return true;
    }
    let max_edits = if candidate.len() <= 5 { 1 } else { 2 };
    strsim::damerau_levenshtein(key, candidate) <= max_edits
}

/// An unknown-key error naming the full path, the closest valid key and the valid keys.
pub(crate) fn unknown_key(parent: &str, key: &str, valid: &[&str]) -> Error {
    let mut e = Error::config(join(parent, key), "unknown key");
    if let Some(s) = closest(key, valid) {
        e = e.with("did_you_mean", s);
    }
    e.with("valid_keys", valid.join(", "))
}

/// The value as an object.
pub(crate) fn object<'a>(path: &str, v: &'a Value) -> Result<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| type_error(path, "an object", v))
}

/// The value as a string.
pub(crate) fn string<'a>(path: &str, v: &'a Value) -> Result<&'a str> {
    v.as_str().ok_or_else(|| type_error(path, "a string", v))
}

/// The value as a boolean (`true` / `false`, not strings or numbers).
pub(crate) fn boolean(path: &str, v: &Value) -> Result<bool> {
    v.as_bool()
        .ok_or_else(|| type_error(path, "a boolean (true or false)", v))
}

/// Largest integer an `f64` holds exactly.
const MAX_EXACT_F64_INT: f64 = 9_007_199_254_740_992.0;

/// The value as a non-negative integer. A float with no fractional part (`3.0`, `6.8e10`) is
/// accepted when it is exact; anything else is a type error that says `expected`.
pub(crate) fn integer(path: &str, v: &Value, expected: &str) -> Result<u64> {
    if let Some(n) = v.as_u64() {
        return Ok(n);
    }
    if let Some(n) = v.as_i64() {
        // as_u64 failed, so n < 0.
        return Err(range_error(path, expected, n));
    }
    if let Some(f) = v.as_f64()
        && f.fract() == 0.0
        && (0.0..=MAX_EXACT_F64_INT).contains(&f)
    {
        return Ok(f as u64);
    }
    Err(type_error(path, expected, v))
}

/// The value as an integer that fits `u32`, within `min..`.
pub(crate) fn integer_u32(path: &str, v: &Value, min: u32, expected: &str) -> Result<u32> {
    let n = integer(path, v, expected)?;
    match u32::try_from(n) {
        Ok(n) if n >= min => Ok(n),
        _ => Err(range_error(path, expected, n)),
    }
}

/// The value as a finite number (integer or float).
pub(crate) fn number(path: &str, v: &Value, expected: &str) -> Result<f64> {
    match v.as_f64() {
        Some(f) if f.is_finite() => Ok(f),
        Some(f) => Err(range_error(path, expected, f)),
        None => Err(type_error(path, expected, v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn paths_join() {
        assert_eq!(join("", "a"), "a");
        assert_eq!(
            join(&index("secondary_tiers", 1), "backpressure"),
            "secondary_tiers[1].backpressure"
        );
    }

    #[test]
    fn closest_suggests_only_plausible_keys() {
        let valid = ["backpressure", "locality", "type", "module_path"];
        assert_eq!(closest("backpresure", &valid), Some("backpressure"));
        assert_eq!(closest("Locality", &valid), Some("locality"));
        assert_eq!(closest("zzzz", &valid), None);
        assert_eq!(closest("lur", &["lru", "arc"]), Some("lru"));
        assert_eq!(
            closest("cpu_byte", &["cpu_bytes_to_use", "block_size"]),
            Some("cpu_bytes_to_use")
        );
        assert_eq!(closest("tpe", &["type", "paths"]), Some("type"));
    }

    #[test]
    fn near_miss_is_tight_for_short_keys() {
        assert!(is_near_miss("backpresure", "backpressure"));
        assert!(is_near_miss("tpye", "type"));
        assert!(is_near_miss("TYPE", "type"));
        assert!(!is_near_miss("type", "type"));
        assert!(!is_near_miss("size", "type"));
        assert!(!is_near_miss("paths", "type"));
    }

    #[test]
    fn integers_accept_exact_floats_only() {
        assert_eq!(integer("k", &json!(7), "n").unwrap(), 7);
        assert_eq!(integer("k", &json!(6.8e10), "n").unwrap(), 68_000_000_000);
        assert!(integer("k", &json!(1.5), "n").is_err());
        let e = integer("k", &json!(-3), "a non-negative integer").unwrap_err();
        assert_eq!(e.context_value("found"), Some("-3"));
        let e = integer("k", &json!("7"), "an integer").unwrap_err();
        assert_eq!(e.context_value("found"), Some("string \"7\""));
        assert!(integer_u32("k", &json!(0), 1, "> 0").is_err());
        assert!(integer_u32("k", &json!(1u64 << 33), 1, "> 0").is_err());
    }

    #[test]
    fn long_strings_are_shortened() {
        let d = describe(&json!("x".repeat(200)));
        assert!(d.len() < 80, "{d}");
    }
}
