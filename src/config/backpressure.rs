//! Back-pressure configuration: parsing one `backpressure` dict, the field-by-field merge of
//! vLLM's `TieringOffloadingSpec.__init__`, the tier-type-aware presets and validation.
//!
//! Order (vLLM 0.33.0, contract §7.5):
//! 1. start from the top-level `backpressure` dict;
//! 2. overlay the tier's own `backpressure` dict field by field (tier values win);
//! 3. the tier is configured only if a source contributed a field or the tier has an explicit
//!    `backpressure` key (even `{}` or `null`); otherwise it gets no detector and never drops
//!    stores;
//! 4. a configured tier must name its detector (`backpressure_cls`, from either dict): vLLM's
//!    factory raises `ValueError` without it, and so does kvtier;
//! 5. fill only the missing keys: water marks from the NETWORK preset (`locality` REMOTE, or an
//!    `obj` tier) or the LOCAL preset, `failure_threshold = 3` for storage tier types (`fs`,
//!    `obj`, and kvtier's `nvme`), then the detector's own defaults.
//!
//! Values keep vLLM's meanings where vLLM gives them one: a top-level `backpressure: null` is no
//! contribution, `failure_threshold: null` means no failure trip (and is not replaced by the
//! tier type's 3), `decay_half_life_s <= 0` means no idle decay, `policy_cls: ""` or `null` the
//! default policy. Nonsense vLLM accepts (negative water marks or cooldown, non-integer counts,
//! booleans or `null` for numbers) is refused with the key path: `docs/configuration.md`
//! lists these deviations.
//!
//! Every field remembers where its value came from, so a conflict (`low_water_s` above
//! `high_water_s`) names both sources.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::fields::{self, join};
use super::model::BackpressureConfig;
use crate::contract::job::Locality;
use crate::error::{Error, Result};

/// The detector class kvtier implements (required once a tier has back-pressure, as in vLLM).
pub const DETECTOR_CLS: &str = "EMABackpressureDetector";
/// The default drop policy (vLLM's default too).
pub const DEFAULT_POLICY_CLS: &str = "ThrottledDropPolicy";
/// Drop policies kvtier implements.
pub const POLICY_CLASSES: [&str; 2] = ["ThrottledDropPolicy", "DropStorePolicy"];
/// vLLM's module for detector and policy classes; a dotted name with this prefix is accepted.
const VLLM_BACKPRESSURE_MODULE: &str = "vllm.v1.kv_offload.tiering.backpressure.";

/// EMA smoothing factor default.
pub const DEFAULT_ALPHA: f64 = 0.15;
/// Completions collected before the EMA starts.
pub const DEFAULT_WARMUP_COMPLETIONS: u32 = 10;
/// Idle-decay half-life, seconds.
pub const DEFAULT_DECAY_HALF_LIFE_S: f64 = 2.0;
/// Cooldown after pressure clears, seconds.
pub const DEFAULT_COOLDOWN_S: f64 = 1.0;
/// Consecutive failed stores that trip pressure, for storage tier types.
pub const DEFAULT_FAILURE_THRESHOLD: u32 = 3;

/// Tier types that get `failure_threshold = 3` by default: vLLM's `fs` and `obj`, and kvtier's
/// own NVMe tier.
pub const STORAGE_TIER_TYPES: [&str; 3] = ["fs", "obj", "nvme"];
/// Tier types that get the NETWORK preset regardless of `locality`.
pub const NETWORK_TIER_TYPES: [&str; 1] = ["obj"];

/// A pair of water marks in seconds per MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WaterMarks {
    /// Preset name (`LOCAL` / `NETWORK`).
    pub name: &'static str,
    /// EMA above this means pressure.
    pub high_water_s: f64,
    /// EMA below this clears pressure.
    pub low_water_s: f64,
}

/// Local storage: ~100 MiB/s per job trips pressure, ~500 MiB/s clears it.
pub const LOCAL_PRESET: WaterMarks = WaterMarks {
    name: "LOCAL",
    high_water_s: 0.010,
    low_water_s: 0.002,
};
/// Network storage (`locality: "REMOTE"`): ~20 MiB/s trips, ~100 MiB/s clears.
pub const NETWORK_PRESET: WaterMarks = WaterMarks {
    name: "NETWORK",
    high_water_s: 0.050,
    low_water_s: 0.010,
};

/// The preset a tier gets (vLLM `EMABackpressureDetector.default_config`).
pub fn preset_for(tier_type: &str, locality: Option<Locality>) -> WaterMarks {
    if locality == Some(Locality::Remote) || NETWORK_TIER_TYPES.contains(&tier_type) {
        NETWORK_PRESET
    } else {
        LOCAL_PRESET
    }
}

/// Every key a `backpressure` dict may hold.
pub const BACKPRESSURE_KEYS: [&str; 9] = [
    "backpressure_cls",
    "policy_cls",
    "high_water_s",
    "low_water_s",
    "alpha",
    "warmup_completions",
    "decay_half_life_s",
    "cooldown_s",
    "failure_threshold",
];

#[derive(Debug, Clone, PartialEq)]
enum FieldValue {
    Text(String),
    Real(f64),
    Count(u32),
    /// An explicit `null` (`failure_threshold`: no trip; class names: not given).
    Null,
}

/// One field with the place its value came from (a key path, a preset or a default).
#[derive(Debug, Clone, PartialEq)]
struct Field {
    value: FieldValue,
    origin: String,
}

/// One `backpressure` dict after type and per-field range checks; keys are
/// [`BACKPRESSURE_KEYS`] entries.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Overlay {
    fields: BTreeMap<&'static str, Field>,
}

fn class_name<'a>(path: &str, v: &'a Value, allowed: &[&str]) -> Result<&'a str> {
    let s = fields::string(path, v)?;
    let short = s.strip_prefix(VLLM_BACKPRESSURE_MODULE).unwrap_or(s);
    if allowed.contains(&short) {
        return Ok(short);
    }
    let mut e = Error::config(path, "unsupported class")
        .with("allowed", allowed.join(", "))
        .with("found", s);
    if let Some(c) = fields::closest(short, allowed) {
        e = e.with("did_you_mean", c);
    }
    Err(e)
}

impl Overlay {
    /// Parses the `backpressure` dict at `path`.
    pub(crate) fn parse(path: &str, v: &Value) -> Result<Overlay> {
        let obj = v.as_object().ok_or_else(|| {
            fields::type_error(
                path,
                "an object such as {\"backpressure_cls\": \"EMABackpressureDetector\"}, or null",
                v,
            )
        })?;
        let mut fields = BTreeMap::new();
        for (k, v) in obj {
            let p = join(path, k);
            let (key, value) = match k.as_str() {
                "backpressure_cls" => (
                    "backpressure_cls",
                    match v {
                        Value::Null => FieldValue::Null,
                        _ => FieldValue::Text(class_name(&p, v, &[DETECTOR_CLS])?.into()),
                    },
                ),
                // vLLM instantiates a policy only for a truthy name: "" and null mean default.
                "policy_cls" => (
                    "policy_cls",
                    match v {
                        Value::Null => FieldValue::Null,
                        Value::String(s) if s.is_empty() => FieldValue::Null,
                        _ => FieldValue::Text(class_name(&p, v, &POLICY_CLASSES)?.into()),
                    },
                ),
                "high_water_s" => (
                    "high_water_s",
                    FieldValue::Real(positive(&p, v, "a number > 0 (s/MiB)")?),
                ),
                "low_water_s" => (
                    "low_water_s",
                    FieldValue::Real(non_negative(&p, v, "a number >= 0 (s/MiB)")?),
                ),
                "alpha" => {
                    let a = fields::number(&p, v, "a number with 0 < alpha <= 1")?;
                    if !(a > 0.0 && a <= 1.0) {
                        return Err(fields::range_error(&p, "0 < alpha <= 1", a));
                    }
                    ("alpha", FieldValue::Real(a))
                }
                "warmup_completions" => (
                    "warmup_completions",
                    FieldValue::Count(fields::integer_u32(&p, v, 0, "an integer >= 0")?),
                ),
                "decay_half_life_s" => (
                    "decay_half_life_s",
                    FieldValue::Real(fields::number(
                        &p,
                        v,
                        "a number of seconds (<= 0: no idle decay)",
                    )?),
                ),
                "cooldown_s" => (
                    "cooldown_s",
                    FieldValue::Real(non_negative(&p, v, "a number of seconds >= 0")?),
                ),
                "failure_threshold" => (
                    "failure_threshold",
                    match v {
                        Value::Null => FieldValue::Null,
                        _ => FieldValue::Count(fields::integer_u32(
                            &p,
                            v,
                            1,
                            "an integer >= 1, or null for no failure trip",
                        )?),
                    },
                ),
                _ => return Err(fields::unknown_key(path, k, &BACKPRESSURE_KEYS)),
            };
            fields.insert(key, Field { value, origin: p });
        }
        Ok(Overlay { fields })
    }

    /// Whether the dict was `{}`.
    pub(crate) fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    fn fill(&mut self, key: &'static str, value: FieldValue, origin: &str) {
        self.fields.entry(key).or_insert_with(|| Field {
            value,
            origin: origin.to_string(),
        });
    }

    fn real(&self, key: &str) -> Option<f64> {
        match self.fields.get(key).map(|f| &f.value) {
            Some(FieldValue::Real(x)) => Some(*x),
            _ => None,
        }
    }

    fn count(&self, key: &str) -> Option<u32> {
        match self.fields.get(key).map(|f| &f.value) {
            Some(FieldValue::Count(x)) => Some(*x),
            _ => None,
        }
    }

    fn text(&self, key: &str) -> Option<String> {
        match self.fields.get(key).map(|f| &f.value) {
            Some(FieldValue::Text(x)) => Some(x.clone()),
            _ => None,
        }
    }

    fn origin(&self, key: &str) -> &str {
        self.fields.get(key).map_or("?", |f| f.origin.as_str())
    }
}

fn positive(path: &str, v: &Value, expected: &str) -> Result<f64> {
    let x = fields::number(path, v, expected)?;
    if x > 0.0 {
        Ok(x)
    } else {
        Err(fields::range_error(path, expected, x))
    }
}

fn non_negative(path: &str, v: &Value, expected: &str) -> Result<f64> {
    let x = fields::number(path, v, expected)?;
    if x >= 0.0 {
        Ok(x)
    } else {
        Err(fields::range_error(path, expected, x))
    }
}

/// Merges the top-level overlay and the tier's own `backpressure` (if the key is present) for
/// the tier at `tier_path`, fills presets and defaults, and validates the result.
/// Returns `None` when the tier has no back-pressure configuration.
pub(crate) fn resolve_for_tier(
    top: Option<&Overlay>,
    tier_entry: &Map<String, Value>,
    tier_path: &str,
    tier_type: &str,
    locality: Option<Locality>,
) -> Result<Option<BackpressureConfig>> {
    let bp_path = join(tier_path, "backpressure");
    let tier_key_present = tier_entry.contains_key("backpressure");
    let tier_overlay = match tier_entry.get("backpressure") {
        // vLLM merges only truthy dicts; the key alone still configures the tier.
        None | Some(Value::Null) => None,
        Some(v) => Some(Overlay::parse(&bp_path, v)?),
    };
    let mut merged = Overlay::default();
    for source in [top, tier_overlay.as_ref()].into_iter().flatten() {
        for (k, f) in &source.fields {
            merged.fields.insert(k, f.clone());
        }
    }
    if merged.is_empty() && !tier_key_present {
        return Ok(None);
    }
    if merged.text("backpressure_cls").is_none() {
        return Err(Error::config(
            join(&bp_path, "backpressure_cls"),
            "required once a tier has back-pressure settings (vLLM's factory refuses them \
             without a detector class too); set it in this tier's backpressure or the top-level one",
        )
        .with("expected", DETECTOR_CLS));
    }

    let preset = preset_for(tier_type, locality);
    let preset_origin = format!("{} preset", preset.name);
    merged.fill(
        "high_water_s",
        FieldValue::Real(preset.high_water_s),
        &preset_origin,
    );
    merged.fill(
        "low_water_s",
        FieldValue::Real(preset.low_water_s),
        &preset_origin,
    );
    if STORAGE_TIER_TYPES.contains(&tier_type) {
        merged.fill(
            "failure_threshold",
            FieldValue::Count(DEFAULT_FAILURE_THRESHOLD),
            &format!("default for {tier_type} tiers"),
        );
    }
    let dflt = "detector default";
    merged.fill(
        "policy_cls",
        FieldValue::Text(DEFAULT_POLICY_CLS.into()),
        dflt,
    );
    merged.fill("alpha", FieldValue::Real(DEFAULT_ALPHA), dflt);
    merged.fill(
        "warmup_completions",
        FieldValue::Count(DEFAULT_WARMUP_COMPLETIONS),
        dflt,
    );
    merged.fill(
        "decay_half_life_s",
        FieldValue::Real(DEFAULT_DECAY_HALF_LIFE_S),
        dflt,
    );
    merged.fill("cooldown_s", FieldValue::Real(DEFAULT_COOLDOWN_S), dflt);

    // Both marks were filled above; the fallbacks only restate the preset. A conflict is
    // explained here with the origin of each mark (the merge knows them); every other rule is
    // BackpressureConfig::validate's, run when the whole configuration is validated.
    let high = merged.real("high_water_s").unwrap_or(preset.high_water_s);
    let low = merged.real("low_water_s").unwrap_or(preset.low_water_s);
    if low > high {
        return Err(Error::config(
            join(tier_path, "backpressure"),
            "low_water_s must be <= high_water_s",
        )
        .with(
            "low_water_s",
            format!("{low} from {}", merged.origin("low_water_s")),
        )
        .with(
            "high_water_s",
            format!("{high} from {}", merged.origin("high_water_s")),
        ));
    }
    let config = BackpressureConfig {
        backpressure_cls: merged.text("backpressure_cls"),
        policy_cls: merged.text("policy_cls"),
        high_water_s: Some(high),
        low_water_s: Some(low),
        alpha: merged.real("alpha"),
        warmup_completions: merged.count("warmup_completions"),
        decay_half_life_s: merged.real("decay_half_life_s"),
        cooldown_s: merged.real("cooldown_s"),
        failure_threshold: merged.count("failure_threshold"),
    };
    Ok(Some(config))
}
