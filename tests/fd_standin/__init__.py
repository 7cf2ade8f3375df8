"""A stand-in for FastDeploy's DynamicWeightManager, used where FastDeploy itself cannot be imported."""
