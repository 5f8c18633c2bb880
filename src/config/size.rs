//! Human byte sizes in configuration values: [`crate::size`] (one parser and printer for config
//! files, flags and messages; it sits below every layer so that any of them can print sizes).

pub use crate::size::*;
