package dev.registry;

import io.apicurio.common.apps.config.DynamicConfigPropertyList;
import java.util.List;
import javax.enterprise.inject.Produces;
import javax.inject.Singleton;

/** The registry's list of settings changeable at run time, empty: this build offers none. */
public class NoDynamicSettings {
    @Produces
    @Singleton
    DynamicConfigPropertyList none() {
        return new DynamicConfigPropertyList(List.of());
    }
}
