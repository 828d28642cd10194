//! quickcheck properties of instance ids and configuration validation.

use kvwarden_core::{Config, ConfigError, InstanceId, REAP_TIMEOUT_FLOOR};
use quickcheck::{TestResult, quickcheck};

quickcheck! {
    fn instance_id_accepts_exactly_the_63_bit_values(raw: u64) -> bool {
        match InstanceId::new(raw) {
            Ok(id) => raw <= InstanceId::MAX && id.get() == raw,
            Err(error) => raw > InstanceId::MAX && error.to_string().contains(&raw.to_string()),
        }
    }

    fn instance_id_from_uuid_is_the_low_63_bits(high: u64, low: u64) -> bool {
        let value = (u128::from(high) << 64) | u128::from(low);
        let id = InstanceId::from_uuid(uuid::Uuid::from_u128(value));
        id.get() <= InstanceId::MAX && u128::from(id.get()) == value & u128::from(InstanceId::MAX)
    }

    fn generated_ids_are_valid_and_distinct(count: u8) -> bool {
        let ids: std::collections::BTreeSet<u64> =
            (0..usize::from(count) + 2).map(|_| InstanceId::generate().get()).collect();
        ids.len() == usize::from(count) + 2 && ids.iter().all(|&raw| raw <= InstanceId::MAX)
    }

    fn config_from_secs_accepts_exactly_the_documented_values(timeout: f64, grace: f64) -> TestResult {
        if timeout.abs() > 1e9 || grace.abs() > 1e9 {
            return TestResult::discard();
        }
        let floor = REAP_TIMEOUT_FLOOR.as_secs_f64();
        let timeout_ok = timeout.is_finite() && (timeout == 0.0 || timeout >= floor);
        let grace_ok = grace.is_finite() && grace >= timeout;
        match Config::from_secs(timeout, grace) {
            Ok(config) => TestResult::from_bool(
                timeout_ok && grace_ok && config.validate().is_ok()
                    && config.reaping_enabled() == (timeout > 0.0),
            ),
            Err(error @ ConfigError::ReapTimeout { .. }) => {
                TestResult::from_bool(!timeout_ok && error.to_string().contains("reap timeout"))
            }
            Err(error @ ConfigError::RegistrationGrace { .. }) => TestResult::from_bool(
                timeout_ok && !grace_ok && error.to_string().contains("registration grace"),
            ),
            Err(_) => TestResult::failed(),
        }
    }

    fn config_from_secs_scales_to_realistic_values(timeout: u16, extra: u16) -> bool {
        let timeout = 30.0 + f64::from(timeout);
        let grace = timeout + f64::from(extra);
        let config = Config::from_secs(timeout, grace).expect("valid by construction");
        config.reap_timeout.as_secs_f64() == timeout && config.registration_grace.as_secs_f64() == grace
    }
}
