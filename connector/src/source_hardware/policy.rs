//! The node's hardware policy (`policy/source-hardware.toml`), compiled in.
//!
//! Which CPU, NIC and SCSI controller models a sandbox may get of its source's, and what
//! replaces the others. The source config is the backup's word: `cpu: host` would hand a
//! restored guest the node's CPU (vmx or svm where nested KVM is on), and a legacy NIC or SCSI
//! model an old device model of QEMU. The policy says, per model, whether the sandbox keeps it
//! or gets a named replacement; the caller reports each replacement as changed and each other
//! model as omitted.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::OnceLock;

pub const SOURCE_HARDWARE_TOML: &str = include_str!("../../../policy/source-hardware.toml");

/// What the policy says of one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict<'a> {
    /// The sandbox gets the model as the source has it.
    Keep,
    /// The sandbox gets `with` instead, for the reason given.
    Replace { with: &'a str, why: &'a str },
    /// Neither allowed nor replaced: the sandbox does not get the model.
    Refuse,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Replacement {
    model: String,
    with: String,
    why: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CpuRules {
    #[serde(default)]
    replace: Vec<Replacement>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelRules {
    allowed: Vec<String>,
    #[serde(default)]
    replace: Vec<Replacement>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    cpu: CpuRules,
    nic: ModelRules,
    scsihw: ModelRules,
}

/// One device family's rules: models kept, and models replaced.
#[derive(Debug)]
struct Family {
    allowed: Vec<String>,
    replaced: BTreeMap<String, (String, String)>,
}

impl Family {
    fn verdict(&self, model: &str) -> Verdict<'_> {
        if self.allowed.iter().any(|m| m == model) {
            return Verdict::Keep;
        }
        match self.replaced.get(model) {
            Some((with, why)) => Verdict::Replace { with, why },
            None => Verdict::Refuse,
        }
    }
}

/// The hardware policy, checked.
#[derive(Debug)]
pub struct HardwarePolicy {
    cpu: BTreeMap<String, (String, String)>,
    nic: Family,
    scsihw: Family,
}

fn replacements(
    family: &str,
    list: Vec<Replacement>,
) -> Result<BTreeMap<String, (String, String)>, String> {
    let mut map = BTreeMap::new();
    for r in list {
        if r.why.trim().is_empty() {
            return Err(format!("{family}.replace of {:?} gives no reason", r.model));
        }
        if map
            .insert(r.model.clone(), (r.with.clone(), r.why.clone()))
            .is_some()
        {
            return Err(format!("{family}.replace lists {:?} twice", r.model));
        }
    }
    Ok(map)
}

fn family(name: &str, rules: ModelRules, known: &[&str]) -> Result<Family, String> {
    let replaced = replacements(name, rules.replace)?;
    for model in &rules.allowed {
        if !known.contains(&model.as_str()) {
            return Err(format!(
                "{name}.allowed names {model:?}, not a model qemu-server accepts"
            ));
        }
        if replaced.contains_key(model) {
            return Err(format!("{name}: {model:?} is both allowed and replaced"));
        }
    }
    for (model, (with, _)) in &replaced {
        if !known.contains(&model.as_str()) {
            return Err(format!(
                "{name}.replace names {model:?}, not a model qemu-server accepts"
            ));
        }
        if !rules.allowed.contains(with) {
            return Err(format!(
                "{name}.replace gives {with:?} for {model:?}, but {with:?} is not allowed"
            ));
        }
    }
    if let Some(missing) = known
        .iter()
        .find(|m| !rules.allowed.iter().any(|a| a == *m) && !replaced.contains_key(**m))
    {
        return Err(format!(
            "{name}: {missing:?}, a model qemu-server accepts, is neither allowed nor replaced"
        ));
    }
    Ok(Family {
        allowed: rules.allowed,
        replaced,
    })
}

impl HardwarePolicy {
    /// Reads and checks a policy: every model qemu-server accepts (`nic_models`,
    /// `scsihw_models`) is allowed or replaced by an allowed one, and a CPU replacement is a
    /// model `cpu_model_ok` accepts that is not itself replaced.
    pub fn parse(
        text: &str,
        nic_models: &[&str],
        scsihw_models: &[&str],
        cpu_model_ok: fn(&str) -> bool,
    ) -> Result<Self, String> {
        let file: PolicyFile = toml::from_str(text).map_err(|e| e.to_string())?;
        let cpu = replacements("cpu", file.cpu.replace)?;
        for (model, (with, _)) in &cpu {
            if !cpu_model_ok(with) || cpu.contains_key(with) {
                return Err(format!(
                    "cpu.replace gives {with:?} for {model:?}: not a named CPU model"
                ));
            }
        }
        Ok(Self {
            cpu,
            nic: family("nic", file.nic, nic_models)?,
            scsihw: family("scsihw", file.scsihw, scsihw_models)?,
        })
    }

    /// The policy compiled into this build, checked once.
    pub fn compiled(
        nic_models: &[&str],
        scsihw_models: &[&str],
        cpu_model_ok: fn(&str) -> bool,
    ) -> Result<&'static HardwarePolicy, String> {
        static COMPILED: OnceLock<Result<HardwarePolicy, String>> = OnceLock::new();
        COMPILED
            .get_or_init(|| {
                Self::parse(
                    SOURCE_HARDWARE_TOML,
                    nic_models,
                    scsihw_models,
                    cpu_model_ok,
                )
                .map_err(|e| format!("policy/source-hardware.toml: {e}"))
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// A CPU model (without its flags): named models are kept.
    pub fn cpu(&self, model: &str) -> Verdict<'_> {
        match self.cpu.get(model) {
            Some((with, why)) => Verdict::Replace { with, why },
            None => Verdict::Keep,
        }
    }

    pub fn nic(&self, model: &str) -> Verdict<'_> {
        self.nic.verdict(model)
    }

    pub fn scsihw(&self, model: &str) -> Verdict<'_> {
        self.scsihw.verdict(model)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const NICS: [&str; 3] = ["virtio", "e1000", "rtl8139"];
    const SCSI: [&str; 2] = ["lsi", "virtio-scsi-pci"];

    fn named(model: &str) -> bool {
        !model.is_empty() && model != "host"
    }

    fn parse(text: &str) -> Result<HardwarePolicy, String> {
        HardwarePolicy::parse(text, &NICS, &SCSI, named)
    }

    const GOOD: &str = r#"
[cpu]
[[cpu.replace]]
model = "host"
with = "x86-64-v2-AES"
why = "the node's CPU"
[nic]
allowed = ["virtio", "e1000"]
[[nic.replace]]
model = "rtl8139"
with = "e1000"
why = "legacy"
[scsihw]
allowed = ["virtio-scsi-pci"]
[[scsihw.replace]]
model = "lsi"
with = "virtio-scsi-pci"
why = "legacy"
"#;

    #[test]
    fn models_are_kept_replaced_or_refused() {
        let policy = parse(GOOD).unwrap();
        assert_eq!(
            policy.cpu("host"),
            Verdict::Replace {
                with: "x86-64-v2-AES",
                why: "the node's CPU"
            }
        );
        assert_eq!(policy.cpu("Skylake-Server-v4"), Verdict::Keep);
        assert_eq!(policy.nic("virtio"), Verdict::Keep);
        assert_eq!(
            policy.nic("rtl8139"),
            Verdict::Replace {
                with: "e1000",
                why: "legacy"
            }
        );
        assert_eq!(policy.nic("tulip"), Verdict::Refuse);
        assert_eq!(policy.scsihw("virtio-scsi-pci"), Verdict::Keep);
        assert!(matches!(policy.scsihw("lsi"), Verdict::Replace { .. }));
    }

    #[test]
    fn a_policy_that_leaves_a_model_unruled_or_replaces_with_a_refused_one_is_refused() {
        let cases = [
            (
                GOOD.replace("allowed = [\"virtio\", \"e1000\"]", "allowed = [\"virtio\"]"),
                "\"e1000\" is not allowed",
            ),
            (
                GOOD.replace("model = \"rtl8139\"", "model = \"tulip\""),
                "\"tulip\", not a model qemu-server accepts",
            ),
            (
                GOOD.replace("[[scsihw.replace]]\nmodel = \"lsi\"\nwith = \"virtio-scsi-pci\"\nwhy = \"legacy\"\n", ""),
                "\"lsi\", a model qemu-server accepts, is neither allowed nor replaced",
            ),
            (
                GOOD.replace("with = \"x86-64-v2-AES\"", "with = \"host\""),
                "not a named CPU model",
            ),
            (
                GOOD.replace("why = \"legacy\"", "why = \" \""),
                "gives no reason",
            ),
            (
                GOOD.replace("allowed = [\"virtio\", \"e1000\"]", "allowed = [\"virtio\", \"e1000\", \"rtl8139\"]"),
                "both allowed and replaced",
            ),
        ];
        for (text, expected) in cases {
            let error = parse(&text).unwrap_err();
            assert!(error.contains(expected), "{error} lacks {expected}");
        }
    }
}
