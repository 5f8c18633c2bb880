//! Store back-pressure, as vLLM 0.33.0's `tiering/backpressure.py` does it (contract doc §7):
//! an EMA of store latency in seconds per MiB with hysteresis, a consecutive-failure trip, idle
//! decay, a cooldown after pressure clears, a healthy bypass, and a drop policy
//! ([`ThrottledDropPolicy`] by default, or [`DropStorePolicy`]).
//!
//! Only stores (cascades) are gated; promotions never are. Time comes from an injectable
//! [`Clock`], so tests are deterministic.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{BackpressureConfig, TierConfig};
use crate::contract::job::Locality;
use crate::error::Result;
use crate::tiering::clock::Clock;

/// One MiB: the EMA is in seconds per MiB.
pub const MIB: f64 = (1u64 << 20) as f64;
/// vLLM's defaults, defined once in the configuration layer.
pub use crate::config::backpressure::{
    DEFAULT_ALPHA, DEFAULT_COOLDOWN_S, DEFAULT_DECAY_HALF_LIFE_S, DEFAULT_WARMUP_COMPLETIONS,
};
#[cfg(any(test, feature = "test-support"))]
pub use crate::config::backpressure::DETECTOR_CLS as DETECTOR_CLASS;
use crate::config::backpressure::{LOCAL_PRESET, NETWORK_PRESET};
/// Consecutive completions below low water after which the gate is bypassed.
pub const HEALTHY_THRESHOLD: u32 = 10;
/// A failure trip lifts the EMA to this multiple of high water.
pub const FAILURE_EMA_FACTOR: f64 = 4.0;
/// [`ThrottledDropPolicy`]'s ramp: drop fraction 0 at high water, 1 at `(1 + ramp) x` high.
pub const DEFAULT_RAMP_FACTOR: f64 = 2.0;
/// LOCAL preset: (high water, low water) in s/MiB.
pub const LOCAL_WATER_MARKS: (f64, f64) = (LOCAL_PRESET.high_water_s, LOCAL_PRESET.low_water_s);
/// NETWORK preset: (high water, low water) in s/MiB.
pub const NETWORK_WATER_MARKS: (f64, f64) =
    (NETWORK_PRESET.high_water_s, NETWORK_PRESET.low_water_s);

/// Which policy decides under pressure (`policy_cls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// `ThrottledDropPolicy` (default): drop fraction ramps from 0 to 1.
    Throttled,
    /// `DropStorePolicy`: drop every store while under pressure.
    DropAll,
}

/// Fully resolved detector parameters (vLLM's `EMABackpressureDetector` kwargs).
#[derive(Debug, Clone, PartialEq)]
pub struct DetectorParams {
    /// EMA above this (s/MiB) means pressure.
    pub high_water_s: f64,
    /// EMA below this (s/MiB) clears pressure.
    pub low_water_s: f64,
    /// Smoothing factor, `0 < alpha <= 1`.
    pub alpha: f64,
    /// Completions averaged before the EMA starts.
    pub warmup_completions: u32,
    /// Idle-decay half-life, seconds.
    pub decay_half_life_s: f64,
    /// Cooldown after pressure clears, seconds.
    pub cooldown_s: f64,
    /// Consecutive failed stores that trip pressure (`None`: failures are ignored).
    pub failure_threshold: Option<u32>,
    /// The drop policy.
    pub policy: PolicyKind,
}

impl DetectorParams {
    /// The LOCAL (`network = false`) or NETWORK preset with vLLM's defaults for everything
    /// else.
    pub fn preset(network: bool, policy: PolicyKind, failure_threshold: Option<u32>) -> Self {
        let (high_water_s, low_water_s) = if network {
            NETWORK_WATER_MARKS
        } else {
            LOCAL_WATER_MARKS
        };
        DetectorParams {
            high_water_s,
            low_water_s,
            alpha: DEFAULT_ALPHA,
            warmup_completions: DEFAULT_WARMUP_COMPLETIONS,
            decay_half_life_s: DEFAULT_DECAY_HALF_LIFE_S,
            cooldown_s: DEFAULT_COOLDOWN_S,
            failure_threshold,
            policy,
        }
    }

    /// The detector of a configured secondary tier: `None` when the tier has no back-pressure
    /// configuration, else [`DetectorParams::resolve`] of its merged config.
    pub fn for_tier(tier: &TierConfig) -> Result<Option<Self>> {
        tier.backpressure
            .as_ref()
            .map(|bp| Self::resolve(bp, &tier.tier_type, tier.locality, &tier.key_path()))
            .transpose()
    }

    /// Resolves a merged config for a tier: missing water marks come from the tier-aware preset
    /// (NETWORK for `REMOTE` locality or type `obj`, else LOCAL), every other missing field
    /// takes vLLM's default, and `failure_threshold` is taken as given (the config merge
    /// already filled the tier type's default; `None` means failures never trip). Validates
    /// with [`BackpressureConfig::validate`].
    pub fn resolve(
        cfg: &BackpressureConfig,
        tier_type: &str,
        locality: Option<Locality>,
        key_path: &str,
    ) -> Result<Self> {
        let network = locality == Some(Locality::Remote) || tier_type == "obj";
        let policy = match cfg.policy_cls.as_deref() {
            Some("DropStorePolicy") => PolicyKind::DropAll,
            _ => PolicyKind::Throttled,
        };
        let d = DetectorParams::preset(network, policy, cfg.failure_threshold);
        let p = DetectorParams {
            high_water_s: cfg.high_water_s.unwrap_or(d.high_water_s),
            low_water_s: cfg.low_water_s.unwrap_or(d.low_water_s),
            alpha: cfg.alpha.unwrap_or(d.alpha),
            warmup_completions: cfg.warmup_completions.unwrap_or(d.warmup_completions),
            decay_half_life_s: cfg.decay_half_life_s.unwrap_or(d.decay_half_life_s),
            cooldown_s: cfg.cooldown_s.unwrap_or(d.cooldown_s),
            ..d
        };
        // The rules are the configuration's own, applied to the values after the defaults.
        BackpressureConfig {
            backpressure_cls: cfg.backpressure_cls.clone(),
            policy_cls: cfg.policy_cls.clone(),
            high_water_s: Some(p.high_water_s),
            low_water_s: Some(p.low_water_s),
            alpha: Some(p.alpha),
            warmup_completions: Some(p.warmup_completions),
            decay_half_life_s: Some(p.decay_half_life_s),
            cooldown_s: Some(p.cooldown_s),
            failure_threshold: p.failure_threshold,
        }
        .validate(key_path)?;
        Ok(p)
    }
}

/// What the gate decided for one store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreDecision {
    /// Create the store job.
    Store,
    /// Drop it (already counted).
    Drop,
}

/// `ThrottledDropPolicy(ramp_factor=2.0)`: under pressure, drops the fraction
/// `min(1, max(0, ema - high) / high / ramp)` of stores, exactly, with an accumulator.
#[derive(Debug, Clone, PartialEq)]
pub struct ThrottledDropPolicy {
    ramp_factor: f64,
    accumulator: f64,
}

impl ThrottledDropPolicy {
    /// The default policy with ramp factor 2.0.
    pub fn new() -> Self {
        ThrottledDropPolicy {
            ramp_factor: DEFAULT_RAMP_FACTOR,
            accumulator: 0.0,
        }
    }

    /// The dropped fraction for an EMA under pressure.
    pub fn drop_rate(&self, ema: f64, high: f64) -> f64 {
        if high <= 0.0 {
            return 1.0;
        }
        let overshoot = py_max(0.0, ema - high) / high;
        (overshoot / self.ramp_factor).min(1.0)
    }

    fn should_store(&mut self, under_pressure: bool, ema: f64, high: f64) -> bool {
        if !under_pressure {
            return true;
        }
        let rate = self.drop_rate(ema, high);
        if rate >= 1.0 {
            return false;
        }
        if rate <= 0.0 {
            return true;
        }
        self.accumulator += rate;
        if self.accumulator >= 1.0 {
            self.accumulator -= 1.0;
            false
        } else {
            true
        }
    }
}

impl Default for ThrottledDropPolicy {
    fn default() -> Self {
        Self::new()
    }
}

/// `DropStorePolicy`: drops every store while under pressure.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DropStorePolicy;

#[derive(Debug, Clone)]
enum Policy {
    Throttled(ThrottledDropPolicy),
    DropAll(DropStorePolicy),
}

/// A pressure transition, for the caller's log and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Pressure turned on.
    Activated,
    /// Pressure turned off.
    Cleared,
}

/// `EMABackpressureDetector` with its drop policy and drop counters.
///
/// The state machine is vLLM 0.33.0's, step for step (checked against vLLM's own code by
/// `tests/python/test_backpressure_vs_vllm.py`): the same fields, updated in the same order,
/// with the same floating-point operations, so the EMA and every decision are bit-for-bit
/// those vLLM computes for the same completions at the same times.
#[derive(Debug)]
pub struct EmaDetector {
    params: DetectorParams,
    name: String,
    clock: Arc<dyn Clock>,
    policy: Policy,
    /// Samples of the warm-up completions (`_warmup_samples`).
    samples: Vec<f64>,
    /// Completions since creation or reset (`_completions`).
    completions: u64,
    ema: f64,
    under_pressure: bool,
    failure_tripped: bool,
    healthy_streak: u32,
    consecutive_failures: u32,
    /// When pressure last cleared (`_pressure_cleared_at`; vLLM's 0.0 is `None`).
    pressure_cleared_at: Option<Instant>,
    cooldown_calls: u64,
    /// When the EMA was last updated or decayed (`_last_update`; vLLM's 0.0 is `None`).
    last_update: Option<Instant>,
    stores_dropped: u64,
    blocks_dropped: u64,
    transitions: Vec<Transition>,
}

/// `0.5 ** exponent` as CPython computes it: C `pow(0.5, exponent)`. The base is opaque to the
/// optimizer: with a constant base LLVM rewrites `powf` into `exp2(-exponent)` in optimized
/// builds, which rounds differently from `pow` for about 0.1 % of exponents (1 ulp).
fn half_pow(exponent: f64) -> f64 {
    std::hint::black_box(0.5f64).powf(exponent)
}

/// Python's `max(a, b)` for floats: `b` only if `b > a`.
fn py_max(a: f64, b: f64) -> f64 {
    if b > a { b } else { a }
}

impl EmaDetector {
    /// A detector named `name` (used in logs: `Tier #1 (nvme)`).
    pub fn new(params: DetectorParams, name: impl Into<String>, clock: Arc<dyn Clock>) -> Self {
        let policy = match params.policy {
            PolicyKind::Throttled => Policy::Throttled(ThrottledDropPolicy::new()),
            PolicyKind::DropAll => Policy::DropAll(DropStorePolicy),
        };
        EmaDetector {
            params,
            name: name.into(),
            clock,
            policy,
            samples: Vec::new(),
            completions: 0,
            ema: 0.0,
            under_pressure: false,
            failure_tripped: false,
            healthy_streak: 0,
            consecutive_failures: 0,
            pressure_cleared_at: None,
            cooldown_calls: 0,
            last_update: None,
            stores_dropped: 0,
            blocks_dropped: 0,
            transitions: Vec::new(),
        }
    }

    /// The resolved parameters.
    pub fn params(&self) -> &DetectorParams {
        &self.params
    }

    /// Current EMA in s/MiB (`stats["store_latency_ema"]`).
    pub fn ema(&self) -> f64 {
        self.ema
    }

    /// Consecutive failed stores (`stats["consecutive_store_failures"]`).
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }

    /// The pressure state as last computed, read without applying idle decay (vLLM's
    /// `_under_pressure`; [`EmaDetector::is_under_pressure`] refreshes it first).
    pub fn pressure_flag(&self) -> bool {
        self.under_pressure
    }

    /// Consecutive completions below low water.
    pub fn healthy_streak(&self) -> u32 {
        self.healthy_streak
    }

    /// Stores and blocks dropped since creation or reset (cumulative).
    pub fn dropped(&self) -> (u64, u64) {
        (self.stores_dropped, self.blocks_dropped)
    }

    /// Transitions since the last call (each is also logged once, when it happens).
    pub fn take_transitions(&mut self) -> Vec<Transition> {
        std::mem::take(&mut self.transitions)
    }

    /// `update(submit_time, num_bytes)`: a completed store that started at `submit_time`.
    /// `num_bytes == 0` is ignored.
    pub fn update(&mut self, submit_time: Instant, num_bytes: u64) {
        if num_bytes == 0 {
            return;
        }
        let elapsed = self.clock.now().saturating_duration_since(submit_time);
        self.on_store_completed(elapsed, num_bytes);
    }

    /// One completed store: `elapsed` for `num_bytes` bytes (`num_bytes == 0` is ignored, as
    /// [`EmaDetector::update`] ignores it in vLLM).
    ///
    /// The first `warmup_completions` completions only collect samples; the last of them sets
    /// the EMA to their mean. Every later one folds in with `alpha` and then decides pressure
    /// (above high water), recovery (below low water, starting the cooldown) or neither.
    pub fn on_store_completed(&mut self, elapsed: Duration, num_bytes: u64) {
        if num_bytes == 0 {
            return;
        }
        let now = self.clock.now();
        let s_per_mib = elapsed.as_secs_f64() / (num_bytes as f64 / MIB);
        self.consecutive_failures = 0;
        self.completions += 1;
        let warmup = u64::from(self.params.warmup_completions);
        if self.completions <= warmup {
            self.samples.push(s_per_mib);
            if self.completions == warmup {
                // Python's sum(): left to right from 0.
                let sum = self.samples.iter().fold(0.0, |acc, x| acc + x);
                self.ema = sum / self.samples.len() as f64;
                self.last_update = Some(now);
            }
            return;
        }
        let alpha = self.params.alpha;
        self.ema = alpha * s_per_mib + (1.0 - alpha) * self.ema;
        self.last_update = Some(now);
        if self.ema > self.params.high_water_s {
            self.set_pressure(true);
            self.pressure_cleared_at = None;
            self.healthy_streak = 0;
        } else if self.ema < self.params.low_water_s {
            if self.under_pressure {
                self.pressure_cleared_at = Some(now);
                self.cooldown_calls = 0;
            }
            self.set_pressure(false);
            self.failure_tripped = false;
            self.healthy_streak = self.healthy_streak.saturating_add(1);
        } else {
            self.healthy_streak = 0;
        }
    }

    /// One failed store. Only counts with a failure threshold: after that many in a row the
    /// EMA is raised to [`FAILURE_EMA_FACTOR`] times high water and pressure starts (during
    /// warm-up too); idle decay later lets a probe store through.
    pub fn on_store_failed(&mut self) {
        let Some(threshold) = self.params.failure_threshold else {
            return;
        };
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.healthy_streak = 0;
        if self.consecutive_failures < threshold {
            return;
        }
        self.ema = py_max(self.ema, self.params.high_water_s * FAILURE_EMA_FACTOR);
        self.last_update = Some(self.clock.now());
        self.set_pressure(true);
        self.failure_tripped = true;
        self.pressure_cleared_at = None;
    }

    /// `ema *= 0.5 ** (dt / half_life)` for the time since the last update; nothing when no
    /// time passed or `decay_half_life_s <= 0` (decay disabled).
    fn apply_idle_decay(&mut self, now: Instant) {
        let dt = match self.last_update {
            Some(last) => now.saturating_duration_since(last).as_secs_f64(),
            // vLLM's "never" is time 0.0: any real clock is far past it. Unreachable while
            // under pressure (every way into pressure sets the update time).
            None => f64::INFINITY,
        };
        let half_life = self.params.decay_half_life_s;
        if dt <= 0.0 || half_life <= 0.0 {
            return;
        }
        self.ema *= half_pow(dt / half_life);
        self.last_update = Some(now);
    }

    /// Refreshes pressure (applying idle decay) and returns it.
    pub fn is_under_pressure(&mut self) -> bool {
        let warmed_up = self.completions >= u64::from(self.params.warmup_completions);
        if self.under_pressure && (warmed_up || self.failure_tripped) {
            let now = self.clock.now();
            self.apply_idle_decay(now);
            if self.ema < self.params.low_water_s {
                self.set_pressure(false);
                self.failure_tripped = false;
                self.pressure_cleared_at = Some(now);
                self.cooldown_calls = 0;
            }
        }
        self.under_pressure
    }

    /// vLLM's `is_healthy`: not under pressure after enough fast completions in a row.
    fn is_healthy(&self) -> bool {
        !self.under_pressure && self.healthy_streak >= HEALTHY_THRESHOLD
    }

    /// The store gate, called with the number of keys of the store: healthy -> store; within
    /// the cooldown after pressure cleared -> every second call dropped; else the policy.
    pub fn should_store(&mut self, num_blocks: usize) -> StoreDecision {
        let under = self.is_under_pressure();
        if self.is_healthy() {
            return StoreDecision::Store;
        }
        if !under && let Some(cleared) = self.pressure_cleared_at {
            let since = self.clock.now().saturating_duration_since(cleared);
            if since.as_secs_f64() < self.params.cooldown_s {
                self.cooldown_calls += 1;
                if self.cooldown_calls.is_multiple_of(2) {
                    self.count_drop(num_blocks);
                    return StoreDecision::Drop;
                }
            }
        }
        // The policies ask the detector again (vLLM's `policy.should_store(detector)`).
        let pressured = self.is_under_pressure();
        let high = self.params.high_water_s;
        let store = match &mut self.policy {
            Policy::Throttled(p) => p.should_store(pressured, self.ema, high),
            Policy::DropAll(_) => !pressured,
        };
        if store {
            StoreDecision::Store
        } else {
            self.count_drop(num_blocks);
            StoreDecision::Drop
        }
    }

    /// Clears all state and the policy (`reset_cache`).
    pub fn reset(&mut self) {
        let fresh = EmaDetector::new(self.params.clone(), self.name.clone(), self.clock.clone());
        let (stores, blocks) = (self.stores_dropped, self.blocks_dropped);
        *self = fresh;
        // Cumulative drop counts feed monotonic counters; they survive a reset.
        self.stores_dropped = stores;
        self.blocks_dropped = blocks;
    }

    /// Whether the warm-up completions have all been seen (the EMA is seeded).
    pub fn is_warmed_up(&self) -> bool {
        self.completions >= u64::from(self.params.warmup_completions)
    }

    fn count_drop(&mut self, num_blocks: usize) {
        self.stores_dropped += 1;
        self.blocks_dropped += num_blocks as u64;
    }

    fn set_pressure(&mut self, on: bool) {
        if on == self.under_pressure {
            return;
        }
        self.under_pressure = on;
        let t = if on {
            Transition::Activated
        } else {
            Transition::Cleared
        };
        self.transitions.push(t);
        log::warn!(
            "{} back-pressure {} (stats={{store_latency_ema: {:.6}, consecutive_store_failures: {}}})",
            self.name,
            if on { "activated" } else { "cleared" },
            self.ema,
            self.consecutive_failures
        );
    }
}

#[cfg(test)]
#[path = "backpressure_tests.rs"]
mod tests;
