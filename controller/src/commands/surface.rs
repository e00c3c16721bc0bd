//! `surface`: the RPC surface this controller is compiled with, as an auditor compares it.

use crate::exit::ExitStatus;

/// `surface`: every RPC of the compiled surface, then its digest.
pub fn surface() -> Result<(), ExitStatus> {
    print!("{}", crate::surface::describe().map_err(ExitStatus::local)?);
    Ok(())
}
