//! Byte sizes on the command line: `4096`, `64K`, `1MiB`, `2G` (binary units).

use crate::error::ArgError;

/// Parses a byte size.
pub(crate) fn parse(s: &str) -> Result<usize, ArgError> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let value: usize = digits
        .parse()
        .map_err(|_| ArgError::NotASize(s.to_string()))?;
    let scale: usize = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => {
            return Err(ArgError::UnknownUnit {
                given: s.to_string(),
                unit: unit.to_string(),
            });
        }
    };
    value
        .checked_mul(scale)
        .ok_or_else(|| ArgError::TooLarge(s.to_string()))
}

/// Formats a byte size the way [`parse`] reads it.
pub(crate) fn format(bytes: usize) -> String {
    const UNITS: [(usize, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (scale, name) in UNITS {
        if bytes >= scale && bytes.is_multiple_of(scale) {
            return format!("{} {name}", bytes / scale);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_units() {
        assert_eq!(parse("4096"), Ok(4096));
        assert_eq!(parse("64K"), Ok(65536));
        assert_eq!(parse("1MiB"), Ok(1 << 20));
        assert_eq!(parse("2g"), Ok(2 << 30));
        assert!(
            parse("12X")
                .unwrap_err()
                .to_string()
                .contains("unknown unit")
        );
        assert!(parse("K").is_err());
        assert_eq!(format(64 << 20), "64 MiB");
        assert_eq!(format(1000), "1000 B");
    }
}
